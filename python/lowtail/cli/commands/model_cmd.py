"""``lowtail model build``: write the policy network as OpenVINO IR."""

from __future__ import annotations

import argparse
import json
from typing import Any

from lowtail.errors import UsageError
from lowtail.options import add_json, json_to_stdout, output_dir, write_json
from lowtail.render import console, table
from lowtail.render.schema import stamp


def register(sub: Any) -> None:
    p = sub.add_parser("model", help="build the MOBA-style policy network (OpenVINO IR)")
    msub = p.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    b = msub.add_parser("build", help="write the policy network as OpenVINO IR, deterministic from --seed")
    # The network's defaults live in lowtail.serve.model, which imports numpy and OpenVINO: it is
    # loaded when a model is built, not for --help.
    b.add_argument("--out", default="model", metavar="DIR", type=output_dir(), help="output directory")
    b.add_argument("--seed", type=int, default=0, help="weights seed")
    b.add_argument("--features", type=int, help="observation size (default: the policy network's)")
    b.add_argument("--hidden", metavar="N,N,...", help="hidden layer sizes (default: the policy network's)")
    b.add_argument(
        "--heads",
        metavar="NAME:ACTIONS,...",
        help="softmax action heads; a value head is always added (default: the policy network's)",
    )
    add_json(b, "the model description")
    b.set_defaults(func=run_build)


def run_build(args: argparse.Namespace) -> int:
    from lowtail.serve import model

    try:
        spec = model.ModelSpec(
            features=model.DEFAULT_FEATURES if args.features is None else args.features,
            hidden=model.DEFAULT_HIDDEN if args.hidden is None else model.parse_hidden(args.hidden),
            heads=model.DEFAULT_HEADS if args.heads is None else model.parse_heads(args.heads),
            seed=args.seed,
        )
    except model.ModelSpecError as e:
        raise UsageError(str(e)) from None
    xml = model.write_model(args.out, spec)
    meta = json.loads((xml.parent / "model.json").read_text())
    if not json_to_stdout(args):  # the table first: a file that cannot be written never hides it
        rows = [[model.INPUT_NAME, "input", f"[batch, {spec.features}] float32"]]
        rows += [[n, "softmax head", f"[batch, {s}]"] for n, s in spec.heads]
        rows.append([model.VALUE_NAME, "value head", "[batch, 1]"])
        print(table.render(["tensor", "role", "shape"], rows, title=f"wrote {xml} (seed {spec.seed})"))
        print(f"hidden layers: {list(spec.hidden)}; weights sha256 {meta['bin_sha256'][:16]}...")
    write_json(args.json, {**stamp("model.build"), "xml": str(xml), **meta})
    console.wrote(args)
    return 0
