//! The payload header decoder (format: `lowtail.shm.payload`), for bytes another process wrote.
//! Every read is bounded by the slice, every value checked before use; the same accept/reject as
//! the Python `decode_header` (fuzzed against it: tests/shm/test_native_fuzz.py).

use crate::layout::*;

pub struct Array {
    pub name: String,
    pub code: u8,
    pub shape: Vec<u64>,
}

pub struct Header {
    pub slot_name: Option<String>,
    pub arrays: Vec<Array>,
}

/// `lowtail.nd.<pidns>.<pid>.<token>`: pidns 0 or 1-20 digits without a leading zero (< 2^64), pid
/// 1-7 digits without a leading zero (<= 2^22), token 12 lowercase hex digits.
pub fn is_nd_slot_name(name: &[u8]) -> bool {
    let Some(rest) = name.strip_prefix(b"lowtail.nd.") else { return false };
    let mut parts = rest.split(|&b| b == b'.');
    let (Some(ns), Some(pid), Some(token), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    let decimal = |p: &[u8], max_len: usize| -> Option<u128> {
        if p.is_empty() || p.len() > max_len || !p.iter().all(u8::is_ascii_digit) || (p.len() > 1 && p[0] == b'0') {
            return None;
        }
        Some(p.iter().fold(0u128, |n, &d| n * 10 + (d - b'0') as u128))
    };
    let ns_ok = matches!(decimal(ns, 20), Some(v) if v < 1u128 << 64);
    let pid_ok = matches!(decimal(pid, 7), Some(v) if (1..=1u128 << 22).contains(&v));
    let token_ok = token.len() == 12 && token.iter().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b));
    ns_ok && pid_ok && token_ok
}

pub fn decode(raw: &[u8], external: bool) -> Result<Header, String> {
    let n = raw.len();
    if n < 4 {
        return Err(format!("{n} bytes, expected at least 4"));
    }
    let (version, count, ext_len, zero) = (raw[0] as u64, raw[1] as u64, raw[2] as usize, raw[3]);
    if version != P_HEADER_VERSION || zero != 0 {
        return Err(format!("version {version} (reserved byte {zero}), expected version {P_HEADER_VERSION}"));
    }
    if !(1..=P_MAX_ARRAYS).contains(&count) {
        return Err(format!("{count} arrays, expected 1..{P_MAX_ARRAYS}"));
    }
    if (ext_len > 0) != external {
        return Err(format!("segment-name length {ext_len} disagrees with the external flag ({external})"));
    }
    let mut pos = 4 + ext_len;
    if pos > n {
        return Err(format!("segment name of {ext_len} bytes runs past the {n}-byte header"));
    }
    let mut slot_name = None;
    if ext_len > 0 {
        let name = &raw[4..pos];
        if !is_nd_slot_name(name) {
            return Err(format!("ndarray segment name {:?} is not a lowtail.nd.* segment name", String::from_utf8_lossy(name)));
        }
        slot_name = Some(String::from_utf8_lossy(name).into_owned());
    }
    let mut arrays: Vec<Array> = Vec::with_capacity(count as usize);
    for i in 0..count {
        let Some(head) = raw.get(pos..pos + 4) else {
            return Err(format!("array {i} runs past the {n}-byte header"));
        };
        let (code, rank, name_len, zero) = (head[0] as u64, head[1] as usize, head[2] as usize, head[3]);
        pos += 4;
        if !(1..=P_DTYPE_COUNT).contains(&code) || zero != 0 {
            return Err(format!("array {i} has dtype code {code}, expected 1..{P_DTYPE_COUNT}"));
        }
        if !(1..=P_MAX_RANK as usize).contains(&rank) || name_len == 0 {
            return Err(format!("array {i} has rank {rank} and name length {name_len}, expected 1..{P_MAX_RANK} and >= 1"));
        }
        let end = pos + 8 * rank + name_len;
        let Some(body) = raw.get(pos..end) else {
            return Err(format!("array {i} runs past the {n}-byte header"));
        };
        let shape: Vec<i64> = (0..rank).map(|k| i64::from_le_bytes(body[8 * k..8 * k + 8].try_into().unwrap())).collect();
        let Ok(name) = String::from_utf8(body[8 * rank..].to_vec()) else {
            return Err(format!("array {i}'s name is not UTF-8"));
        };
        pos = end;
        if shape.iter().any(|&d| d < 0 || d as u64 >= P_MAX_DIM) {
            return Err(format!("array {name:?} has dims {shape:?}, expected each in 0..{}", P_MAX_DIM - 1));
        }
        if arrays.iter().any(|a| a.name == name) {
            return Err(format!("array name {name:?} appears twice"));
        }
        arrays.push(Array { name, code: code as u8, shape: shape.into_iter().map(|d| d as u64).collect() });
    }
    if pos != n {
        return Err(format!("{} trailing bytes after {count} arrays", n - pos));
    }
    let batch = arrays[0].shape[0];
    if batch < 1 || arrays.iter().any(|a| a.shape[0] != batch) {
        return Err("batch dimension must be >= 1 and the same for all arrays".into());
    }
    Ok(Header { slot_name, arrays })
}
