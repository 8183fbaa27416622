"""``lowtail model build``: write the policy network as OpenVINO IR."""

from __future__ import annotations

import argparse
import json
from typing import Any

from lowtail.cli.main import UsageError
from lowtail.render import table
from lowtail.serve import model


def register(sub: Any) -> None:
    p = sub.add_parser("model", help="build the MOBA-style policy network (OpenVINO IR)")
    msub = p.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    b = msub.add_parser("build", help="write the policy network as OpenVINO IR, deterministic from --seed")
    b.add_argument("--out", default="model", metavar="DIR", help="output directory (default: ./model)")
    b.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    b.add_argument("--features", type=int, default=model.DEFAULT_FEATURES, help="observation size")
    b.add_argument(
        "--hidden",
        default=",".join(str(h) for h in model.DEFAULT_HIDDEN),
        metavar="N,N,...",
        help="hidden layer sizes",
    )
    b.add_argument(
        "--heads",
        default=",".join(f"{n}:{s}" for n, s in model.DEFAULT_HEADS),
        metavar="NAME:ACTIONS,...",
        help="softmax action heads (a value head is always added)",
    )
    b.add_argument("--json", action="store_true", help="print the model description as JSON")
    b.set_defaults(func=run_build)


def run_build(args: argparse.Namespace) -> int:
    try:
        spec = model.ModelSpec(
            features=args.features,
            hidden=model.parse_hidden(args.hidden),
            heads=model.parse_heads(args.heads),
            seed=args.seed,
        )
    except model.ModelSpecError as e:
        raise UsageError(str(e)) from None
    xml = model.write_model(args.out, spec)
    meta = json.loads((xml.parent / "model.json").read_text())
    if args.json:
        print(json.dumps({"xml": str(xml), **meta}, indent=2))
        return 0
    rows = [[model.INPUT_NAME, "input", f"[batch, {spec.features}] float32"]]
    rows += [[n, "softmax head", f"[batch, {s}]"] for n, s in spec.heads]
    rows.append([model.VALUE_NAME, "value head", "[batch, 1]"])
    print(table.render(["tensor", "role", "shape"], rows, title=f"wrote {xml} (seed {spec.seed})"))
    print(f"hidden layers: {list(spec.hidden)}; weights sha256 {meta['bin_sha256'][:16]}...")
    return 0
