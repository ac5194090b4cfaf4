"""CPU timing of our decoding loop against HF generate, greedy, on the ~5M-parameter policy of
measure_continuous.py (hidden 256): 32 prompts of 32 random tokens, 64 new tokens (or
--new-tokens), 1 thread, best of 3 with the three alternating: ours (eager steps attend to the
cache columns written so far), ours attending to every column (as before 2026-12-02, and as the
CUDA-graph step does) and HF generate; the outputs must agree. Used for docs/RESULTS.md:

    PYTHONPATH=. python tools/measure_greedy_vs_hf.py --new-tokens 64
"""
from __future__ import annotations

import argparse
import time

import torch
from measure_continuous import policy

import ds_ppo.engine.generation.loop as decode_module
from ds_ppo.engine.generation.loop import decode
from ds_ppo.engine.generation.slots import Slots


class EveryColumn(Slots):
    """Slots whose eager steps attend to all P + T cache columns (trim off)."""

    def __init__(self, *args, trim: bool = False, **kwargs):
        super().__init__(*args, trim=False, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    T = ap.parse_args().new_tokens
    torch.set_num_threads(1)
    model = policy(4096, 256, 4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 4096, (32, 32), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)

    def ours():
        return decode(model, ids, mask, max_new_tokens=T, eos_ids=[2], pad_id=0,
                      temperature=0.0, suppress_ids=[0]).response_ids

    def every_column():
        decode_module.Slots = EveryColumn
        try:
            return ours()
        finally:
            decode_module.Slots = Slots

    def hf():
        return model.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=T,
                              do_sample=False, eos_token_id=[2], pad_token_id=0,
                              suppress_tokens=[0])[:, ids.shape[1]:]

    contenders = (("ours", ours), ("every column", every_column), ("hf", hf))
    best = {name: float("inf") for name, _ in contenders}
    with torch.no_grad():
        for _ in range(3):
            outs = {}
            for name, fn in contenders:
                t0 = time.perf_counter()
                outs[name] = fn()
                best[name] = min(best[name], time.perf_counter() - t0)
            width = outs["ours"].shape[1]
            assert torch.equal(outs["ours"], outs["hf"][:, :width]), "greedy outputs differ"
            assert torch.equal(outs["ours"], outs["every column"]), "greedy outputs differ"
    print(f"{T} new tokens: ours {best['ours']:.2f} s, ours attending to every column "
          f"{best['every column']:.2f} s, HF generate {best['hf']:.2f} s; ours / HF = "
          f"{best['ours'] / best['hf']:.2f}, every column / HF = "
          f"{best['every column'] / best['hf']:.2f}")


if __name__ == "__main__":
    main()
