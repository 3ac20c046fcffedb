#!/usr/bin/env python
"""Prepare a LibriTTS-layout corpus (real LibriTTS or the toy corpus).

  tokens     corpus -> filters -> text + speech tokens -> parquet shards (resumable, parallel)
  zero-shot  corpus -> the zero-shot test list (target + same-speaker prompt) as .jsonl or .csv

Examples:
  python scripts/prepare_libritts.py tokens /data/LibriTTS data/libritts_cosyvoice2 \\
      --subsets train-clean-100 train-clean-360 train-other-500 dev-clean \\
      --text-tokenizer /models/CosyVoice2-0.5B/CosyVoice-BlankEN \\
      --speech-tokenizer cosyvoice2 --speech-tokenizer-path /models/CosyVoice2-0.5B --num-workers 8
  python scripts/prepare_libritts.py tokens /data/LibriTTS data/libritts_llasa \\
      --subsets train-clean-100 train-clean-360 train-other-500 dev-clean \\
      --text-tokenizer /models/Llasa-1B --speech-tokenizer llasa --speech-tokenizer-path /models/xcodec2 \\
      --max-sec 36 --num-workers 4          # LLaSA: docs/target-llasa.md, "Preparing LibriTTS shards"
  python scripts/prepare_libritts.py zero-shot /data/LibriTTS data/test_clean_pairs.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tokenizers load from local dirs only

from ssd.config_files import group_options, option_node  # noqa: E402
from ssd.data.libritts import TEST_CLEAN, make_zero_shot_pairs, save_table, scan_libritts  # noqa: E402
from ssd.data.prepare import prepare_corpus  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    tokens = commands.add_parser("tokens", help="write token shards (see ssd/data/prepare.py)")
    tokens.add_argument(
        "corpus_root", help="directory holding the subset folders ({subset}/{speaker}/{chapter}/*.wav)"
    )
    tokens.add_argument(
        "out_dir", help="output directory for shards, manifest.jsonl, plan.json, summary.json"
    )
    tokens.add_argument("--subsets", nargs="+", default=None, help="subset folders to use (default: all)")
    tokens.add_argument(
        "--text-tokenizer", required=True, help="local HF tokenizer dir of the target (LLaSA: its model dir)"
    )
    tokens.add_argument(
        "--speech-tokenizer",
        required=True,
        choices=group_options("speech_tokenizer"),
        help="which speech tokenizer (configs/speech_tokenizer/)",
    )
    tokens.add_argument(
        "--speech-tokenizer-path",
        required=True,
        help="cosyvoice2: speech_tokenizer_v2.onnx or the CosyVoice2-0.5B dir; toy: the toy codec dir; "
        "llasa: the X-codec2 dir (config.json + model.safetensors)",
    )
    tokens.add_argument("--shard-size", type=int, default=1000, help="utterances per shard (default 1000)")
    tokens.add_argument(
        "--num-workers", type=int, default=2, help="tokenizer processes; 0 = in process (default 2)"
    )
    tokens.add_argument("--min-sec", type=float, default=1.0, help="drop shorter audio (default 1 s)")
    tokens.add_argument("--max-sec", type=float, default=60.0, help="drop longer audio (default 60 s)")
    tokens.add_argument(
        "--min-text-tokens", type=int, default=1, help="drop texts with fewer tokens (default 1)"
    )
    tokens.add_argument(
        "--max-text-tokens", type=int, default=200, help="drop texts with more tokens (default 200)"
    )
    tokens.add_argument("--no-progress", action="store_true", help="no progress bar")

    pairs = commands.add_parser(
        "zero-shot", help="write the zero-shot test list (rule: ssd/data/libritts.py)"
    )
    pairs.add_argument("corpus_root", help="directory holding the subset folders")
    pairs.add_argument("out_path", help="output .jsonl or .csv")
    pairs.add_argument(
        "--subsets", nargs="+", default=["test-clean"], help="subsets to draw from (default test-clean)"
    )
    pairs.add_argument(
        "--exclude-speakers-of",
        nargs="+",
        default=[],
        metavar="SUBSET",
        help="leave out speakers seen in these subsets",
    )
    pairs.add_argument(
        "--n-utts", type=int, default=TEST_CLEAN["n_utts"], help="targets (default 500, as the paper)"
    )
    pairs.add_argument(
        "--n-speakers", type=int, default=TEST_CLEAN["n_speakers"], help="speakers (default 37)"
    )
    pairs.add_argument(
        "--prompt-sec", type=float, nargs=2, default=TEST_CLEAN["prompt_sec"], metavar=("LO", "HI")
    )
    pairs.add_argument(
        "--target-sec", type=float, nargs=2, default=TEST_CLEAN["target_sec"], metavar=("LO", "HI")
    )
    pairs.add_argument("--seed", type=int, default=TEST_CLEAN["seed"])
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.command == "tokens":
        prepare_corpus(
            args.corpus_root,
            args.out_dir,
            text_tokenizer=args.text_tokenizer,
            speech_tokenizer=option_node(
                "speech_tokenizer", args.speech_tokenizer, path=args.speech_tokenizer_path
            ),
            subsets=args.subsets,
            shard_size=args.shard_size,
            num_workers=args.num_workers,
            min_sec=args.min_sec,
            max_sec=args.max_sec,
            min_text_tokens=args.min_text_tokens,
            max_text_tokens=args.max_text_tokens,
            progress=not args.no_progress,
        )
    else:
        manifest = scan_libritts(args.corpus_root, args.subsets).manifest
        seen = (
            scan_libritts(args.corpus_root, args.exclude_speakers_of).manifest["speaker"]
            if args.exclude_speakers_of
            else ()
        )
        pairs = make_zero_shot_pairs(
            manifest,
            n_utts=args.n_utts,
            n_speakers=args.n_speakers,
            prompt_sec=tuple(args.prompt_sec),
            target_sec=tuple(args.target_sec),
            seed=args.seed,
            exclude_speakers=seen,
        )
        save_table(pairs, args.out_path)
        print(f"{len(pairs)} zero-shot pairs over {pairs['speaker'].nunique()} speakers -> {args.out_path}")


if __name__ == "__main__":
    main()
