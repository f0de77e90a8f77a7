"""Time one multi-turn rollout (phase 1 of a step with tools) whose calculator sleeps 0.5 s per call:
calls one by one (tool_workers=1, no overlap) against a pool, with and without overlap.

    python scripts/bench_tool_overlap.py [--repeats 3] [--copies 4] [--sleep 0.5]

The real hf engine on tests/test_tools.py's tiny Qwen2 (memorised here, about 20 s): `copies` x
[calculator question, calculator question, "Say hi.", "Say hi."] (rollout_n=2, prompt-major), so
2 x copies calls per rollout, 0.5 s each. Prints the median wall time per setting, alternating
settings each repeat; and the same with the calculator's own (instant) speed, the overlap's cost.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from rollout import SamplingParams  # noqa: E402
from rollout.hf import HFEngine  # noqa: E402
from rollout.tools import ChatFormat, ToolEnvironment, ToolSet, calculator, run_multiturn  # noqa: E402
from test_tools import CALC, MEMORISED, explode, memorise, qwen_style_tokenizer  # noqa: E402

SETTINGS = {"one by one (tool_workers=1, no overlap)": dict(tool_workers=1, overlap=False),
            "pool (tool_workers=8, no overlap)": dict(tool_workers=8, overlap=False),
            "pool + overlap (tool_workers=8)": dict(tool_workers=8, overlap=True)}


def sleepy(seconds: float):
    def calculator_(expression: str) -> str:
        time.sleep(seconds)
        return calculator(expression)
    calculator_.__name__, calculator_.__doc__ = "calculator", calculator.__doc__   # the schema the model saw
    return calculator_


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--sleep", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a tiny model: one is steadiest on a shared CPU)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = qwen_style_tokenizer()
    _, model, _ = memorise(tokenizer, ToolSet.from_specs([CALC, "test_tools:explode"]))
    engine = HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    prompts = [[{"role": "user", "content": MEMORISED[k][0]}] for k in [0, 0, 1, 1] * args.copies]
    for label, seconds in [(f"calculator sleeping {args.sleep} s per call", args.sleep), ("instant calculator", 0.0)]:
        tools = ToolSet([sleepy(seconds), explode])
        chat = ChatFormat(tokenizer, tools.schemas)
        times = {name: [] for name in SETTINGS}
        for _ in range(args.repeats):
            for name, kw in SETTINGS.items():
                torch.manual_seed(0)
                start = time.perf_counter()
                out = run_multiturn(engine, chat, prompts, [ToolEnvironment(tools) for _ in prompts],
                                    SamplingParams(temperature=0.1), 1000, 4, **kw)
                times[name].append(time.perf_counter() - start)
                assert sum(t.tool_calls for t in out) == 2 * args.copies, "the model did not call the tool"
        print(f"{label}, {2 * args.copies} calls per rollout, {len(prompts)} trajectories:")
        for name, ts in times.items():
            print(f"  {name:40s} median {statistics.median(ts):.2f} s  ({', '.join(f'{t:.2f}' for t in ts)})")


if __name__ == "__main__":
    main()
