"""Tables (markdown, LaTeX, CSV) and figures over all runs of a sweep dir.

python scripts/make_tables.py <sweep dir>                       # table.{md,tex,csv} + fig_*.png
python scripts/make_tables.py <test sweep> --select-on <dev sweep>
    # choose beta / L_d on the dev sweep (fastest setting whose WER CI overlaps AR's), report it on test
python scripts/make_tables.py <sweep dir> --baseline <AR run dir>  # speedup, ΔWER vs a run outside the sweep

Speedup and ΔWER vs AR (paired, 95% CI) come from each run's own AR baseline (metrics.json baseline_dir:
a sweep's jobs run it into <sweep dir>/baselines/), else from the sweep's decoding=ar runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ssd.evaluation.report import aggregate  # noqa: E402
from ssd.evaluation.selection import matching_row, select_setting  # noqa: E402
from ssd.evaluation.tables import display_table, reference_rows, setting_of, to_markdown, with_ci  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument(
        "--baseline", type=Path, default=None, help="AR run dir to compute speedups and ΔWER against"
    )
    parser.add_argument(
        "--select-on",
        type=Path,
        default=None,
        metavar="DEV_SWEEP_DIR",
        help="choose the setting on this dev sweep and report it from sweep_dir (test)",
    )
    parser.add_argument("--no-figures", action="store_true")
    args = parser.parse_args(argv)

    table = aggregate(args.sweep_dir, args.baseline, figures=not args.no_figures)
    print((args.sweep_dir / "table.md").read_text())
    print(f"written: {', '.join(str(args.sweep_dir / n) for n in ('table.md', 'table.tex', 'table.csv'))}")
    if args.select_on is not None:
        dev = aggregate(args.select_on, args.baseline, figures=False)
        chosen = select_setting(dev)
        print(
            f"\nchosen on dev ({args.select_on}): {setting_of(chosen)} (dev speedup {with_ci(chosen, 'speedup')}, "
            f"dev LM-RTF {chosen['lm_rtf']:.3f}, dev WER {chosen['wer'] * 100:.1f}%)"
        )
        test_row = matching_row(table, chosen)
        ar = table[reference_rows(table)]
        print("reported on test:\n")
        print(to_markdown(display_table(table.loc[[*ar.index, test_row.name]])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
