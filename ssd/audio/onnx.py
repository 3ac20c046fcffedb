"""The project's one way to open an ONNX model (speech tokenizer, CAM++, DNSMOS)."""

from __future__ import annotations

import os


def onnx_session(path: str | os.PathLike, num_threads: int | None = 1, providers: list[str] | None = None,
                allow_spinning: bool = False):  # fmt: skip
    """An onnxruntime InferenceSession with `num_threads` intra-op threads (None or 0: onnxruntime's default,
    every core) and no inter-op pool. Idle workers sleep rather than busy-wait (`allow_spinning=False`): a
    spinning worker keeps a core busy after the call returns and slows the LM decode timed next (1.2x on 2
    cores; `python scripts/bench_judge_isolation.py` measures it)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = int(num_threads or 0)
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
    return onnxruntime.InferenceSession(str(path), options, providers=providers or ["CPUExecutionProvider"])
