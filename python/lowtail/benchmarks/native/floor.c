/* The native spin floor of `lowtail bench queue` (transport native_floor): two processes ping-pong a
 * sequence word through shared memory with the same copies as the queue's round trip (16 x 512 f32 in,
 * 16 x 64 f32 out: the client copies the request in; the server gathers the first 64 columns of each
 * row from the request in place and copies them into the answer, as lowtail's `bench queue` server does
 * with `np.ascontiguousarray(obs[:, :64])` and `Batch.complete`; the client copies the answer out).
 * Compiled by the harness with the host's C compiler at first use; nothing here is downloaded.
 *
 * Segment: word 0 request seq (client), word 8 answer seq (server), word 16 server ready, word 24 stop
 * (client); the request at byte 128, the answer after it. Every spin is bounded. */
#include <stdint.h>
#include <string.h>
#include <time.h>

#define ROWS 16
#define IN_COLS 512
#define OUT_COLS 64
#define REQ_OFF 128
#define RESP_OFF (REQ_OFF + ROWS * IN_COLS * 4)

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint64_t load(volatile uint64_t *w) { return __atomic_load_n(w, __ATOMIC_ACQUIRE); }
static inline void store(volatile uint64_t *w, uint64_t v) { __atomic_store_n(w, v, __ATOMIC_RELEASE); }

/* The server: spins on the request word until stop is set; returns the requests it answered. It reads
 * 4 KiB of the 32 KiB request, as lowtail's server does (until 2026-12-07 it copied the whole request
 * first: work lowtail's server does not do, which made the floor no floor). */
uint64_t floor_serve(uint8_t *seg) {
    volatile uint64_t *words = (volatile uint64_t *)seg;
    static float local[ROWS * OUT_COLS];
    uint64_t last = load(&words[0]), served = 0;
    store(&words[2], 1);
    while (!load(&words[3])) {
        uint64_t seq = load(&words[0]);
        if (seq == last) {
            __builtin_ia32_pause();
            continue;
        }
        last = seq;
        const float *req = (const float *)(seg + REQ_OFF);
        for (int r = 0; r < ROWS; r++) memcpy(local + r * OUT_COLS, req + r * IN_COLS, OUT_COLS * 4);
        memcpy(seg + RESP_OFF, local, sizeof local);
        store(&words[1], seq);
        served++;
    }
    return served;
}

/* One round trip from the client: copy `in` in, publish, spin for the answer (at most timeout_ns),
 * copy it to `out`. Returns 0, or -1 on timeout. */
int floor_round_trip(uint8_t *seg, const float *in, float *out, uint64_t seq, uint64_t timeout_ns) {
    volatile uint64_t *words = (volatile uint64_t *)seg;
    memcpy(seg + REQ_OFF, in, ROWS * IN_COLS * 4);
    store(&words[0], seq);
    uint64_t deadline = now_ns() + timeout_ns;
    unsigned spins = 0;
    while (load(&words[1]) != seq) {
        __builtin_ia32_pause();
        if (++spins % 1024 == 0 && now_ns() > deadline) return -1;
    }
    memcpy(out, seg + RESP_OFF, ROWS * OUT_COLS * 4);
    return 0;
}
