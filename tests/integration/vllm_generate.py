"""Run by tests/integration/test_vllm.py in a fresh process: start ``vllm.LLM`` on a model folder
(from local files, or ``--ref MODEL:TAG`` with ``load_format="pdparams"``), generate greedily for a
few prompts and print one JSON line: the token ids and the log-probability of each chosen token.

``--expect-error``: the LLM must fail to start with ``PdparamsLoadError``; prints its exit code and
message as JSON instead (each ``--ref`` and each ``--case`` is tried in turn, in this one process;
a case is ``{"extra": {...}, "folder": DIR}``, the folder defaulting to the positional one).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

PROMPTS = [[1, 5, 9, 200], [3, 700, 12], [42] * 7, [1000, 2, 3, 4, 5, 6, 7, 8, 9]]


def engine(folder: str, ref: str | None, extra: dict[str, Any] | None = None) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if ref is not None or extra is not None:
        kwargs = {"load_format": "pdparams", "model_loader_extra_config": extra if extra is not None else {"ref": ref}}
    # 0.05 of host memory for the KV cache: plenty for 4 prompts of 128 tokens, and it fits beside the suite.
    return LLM(model=folder, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128, enforce_eager=True,
               gpu_memory_utilization=0.05, seed=0, **kwargs)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("--ref", action="append", default=[])
    p.add_argument("--case", action="append", default=[], help='an error case as JSON: {"extra": {...}, "folder": DIR}')
    p.add_argument("--expect-error", action="store_true")
    args = p.parse_args()
    if args.expect_error:
        from worker.vllm_loader import PdparamsLoadError

        results = []
        cases: list[dict[str, Any]] = [{"extra": {"ref": r}} for r in args.ref] + [json.loads(c) for c in args.case]
        for case in cases:
            try:
                engine(case.get("folder", args.folder), None, case["extra"])
            except PdparamsLoadError as exc:
                results.append({"code": exc.exit_code, "message": str(exc)})
            else:
                results.append({"code": 0, "message": "started"})
        print("RESULT " + json.dumps(results))
        return 0
    from vllm import SamplingParams

    llm = engine(args.folder, args.ref[0] if args.ref else None)
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=0)
    out = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params, use_tqdm=False)
    rows = []
    for o in out:
        c = o.outputs[0]
        logprobs = [float(step[tok].logprob) for tok, step in zip(c.token_ids, c.logprobs or [])]
        rows.append({"ids": list(c.token_ids), "logprobs": logprobs})
    print("RESULT " + json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
