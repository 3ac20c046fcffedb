"""Reproduce a paper table or figure: `python scripts/reproduce.py <name>|all [--out DIR] [KEY=VALUE ...]`.

Runs the experiment's sweeps (sweep.py) and trainings (train_draft.py) into <out>/<name>/runs/ and writes
tables, figures, command.txt, git_commit.txt, machine.txt and summary.md into <out>/<name>/ (the logic and
the list of files: ssd/experiments/). Rerunning resumes. Examples:

    python scripts/reproduce.py table3_beta                       # the toy world (paths.data_dir default)
    python scripts/reproduce.py all draft.checkpoint=data/toy/draft/draft.pt
    python scripts/reproduce.py table1_main --out /tmp/res target=cosyvoice2 \\
        target.model.model_dir=/models/CosyVoice2-0.5B eval=libritts_test_clean ...   # the real setup

KEY=VALUE overrides go to every command whose config has that key; --train-override KEY=VALUE only to
train_draft.py (e.g. data.shard_dirs=...).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ssd.config_files import group_options  # noqa: E402
from ssd.experiments.driver import default_out, reproduce  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    names = group_options("experiment")
    parser.add_argument("name", help=f"one of {names} or 'all'")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Hydra overrides for every command")
    parser.add_argument(
        "--out", type=Path, default=default_out(), help=f"results root (default {default_out()})"
    )
    parser.add_argument("--train-override", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for train_draft.py only (repeatable)")  # fmt: skip
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.name != "all" and args.name not in names:
        parser.error(f"unknown experiment {args.name!r}: choose one of {names} or 'all'")
    for name in names if args.name == "all" else [args.name]:
        out_dir = reproduce(name, args.out, args.overrides, args.train_override)
        print(f"{name}: {out_dir / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
