"""Multi-turn rollouts: sessions keep their slot and KV cache (``kv``) vs re-prefill per turn, side by side.

    python bench/multiturn_kv.py                             # tiny and 31.6M configs
    python bench/multiturn_kv.py --configs tiny --tool-ms 0,20

Both paths of :func:`rljax.env.run_episodes` run the same episodes on the same weights in one
process: ``--prompts`` prompts x ``--n`` sessions, ``--turns`` model turns of ``--turn-tokens``
tokens each (greedy, no EOS: every turn ends on its budget), and after each turn but the last
an observation of ``--obs-tokens`` tokens from an environment that sleeps ``--tool-ms``
milliseconds per call (a tool's latency; ``time.sleep`` releases the GIL as a subprocess wait
does). ``kv``: a session keeps its slot and cache; each resumed turn prefills only the previous
turn's last token and the observation, and the turns that finished in a decode chunk go to the
environment on a thread pool while the other slots decode. ``reprefill``: each turn is one
``Sampler.generate`` over all sessions whose prompt is the whole context so far, and the
environment answers all sessions' turns (one after the other, the ``Environment.step_many``
default) before the next turn starts.

Reported per path, after two untimed warm-up calls that compile (median of ``--repeats``):
wall seconds of the whole rollout, seconds per turn (wall / turns), tokens prefilled (prompt
prefills + extends: the recompute the KV path avoids), the engine's prefill/extend calls, and
the ratio re-prefill / kv. Both paths give the same tokens (greedy; the last column).

Measured on this project's 2-core CPU machine, shared (load average ~15), ``python
bench/multiturn_kv.py --configs tiny`` and ``--configs 31m --repeats 1``::

    config  tool ms path         wall s   s/turn prefilled prefill+ext calls reprefill/kv same tokens
    tiny          0 kv            0.397    0.099      2046        1+4               0.81x       1.000
    tiny          0 reprefill     0.320    0.080     12768        4+0               1.00x       1.000
    tiny         20 kv            0.373    0.093      2046        1+7               9.40x       1.000
    tiny         20 reprefill     3.504    0.876     12768        4+0               1.00x       1.000
    31m           0 kv           25.482    6.370      2046        1+3               3.07x       1.000
    31m           0 reprefill    78.147   19.537     12768        4+0               1.00x       1.000
    31m          20 kv           18.570    4.643      2046        1+3               1.68x       1.000
    31m          20 reprefill    31.273    7.818     12768        4+0               1.00x       1.000

(31m: one run each while the load swung -- the same re-prefill rollout took 78 s and 31 s.)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, ".")

from rljax.env import Environment, Step, run_episodes  # noqa: E402
from rljax.models import functional as F  # noqa: E402
from rljax.models.config import get_config  # noqa: E402
from rljax.rollout import DecodeParams, RljaxEngine, Sampler  # noqa: E402

from _peer_update import model_31m  # noqa: E402

CONFIGS = {
    "tiny": lambda: get_config("tiny"),
    # bench/peer_trl.py's 31.6M Qwen2 (hidden 512, 8 layers, 8 / 4 heads, MLP 2048).
    "31m": lambda: model_31m(max_position_embeddings=2048, pad_token_id=None, bos_token_id=None, eos_token_id=None),
}


@dataclasses.dataclass(frozen=True)
class Prompt:
    ids: tuple
    prompt: str = ""
    answer: str = ""
    index: int = 0


def make_env(obs_tokens: int, tool_ms: float):
    class Tool(Environment):
        def step(self, turn):
            time.sleep(tool_ms / 1000.0)
            if turn.index == TURNS - 1:
                return Step(reward=0.0)
            return Step(observation="x" * obs_tokens, tool="sleep", seconds=tool_ms / 1000.0)

    return Tool


class Tok:
    """One token per character: 'x' is id 5 (observations), never the stop token."""

    def encode(self, text):
        return [5] * len(text)

    def decode(self, ids):
        return " ".join(str(int(i)) for i in ids)


TURNS = 4


def run(sampler, prompts, args, continuation, env_cls):
    eng = sampler.engine
    before = dict(eng.stats)
    decode = DecodeParams(max_new_tokens=args.turn_tokens, temperature=0.0, eos_ids=(), seed=0)
    t0 = time.perf_counter()
    traj = run_episodes(sampler, prompts, uids=[f"p{i}" for i in range(len(prompts))], n=args.n, decode=decode,
                        env_cls=env_cls, tokenizer=Tok(), stop_id=1, max_turns=TURNS,
                        max_response_tokens=TURNS * args.turn_tokens + (TURNS - 1) * args.obs_tokens,
                        max_obs_tokens=args.obs_tokens, continuation=continuation)
    wall = time.perf_counter() - t0
    d = {k: eng.stats.get(k, 0) - before.get(k, 0) for k in ("prefill_tokens", "extended_tokens", "prefill_calls",
                                                              "extend_calls")}
    return wall, d, traj


def main() -> int:
    global TURNS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="tiny,31m", help=f"comma-separated, from {', '.join(CONFIGS)}")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=16)
    ap.add_argument("--obs-tokens", type=int, default=16)
    ap.add_argument("--tool-ms", default="0,20", help="comma-separated tool latencies (ms per call)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for name in args.configs.split(","):
        if name not in CONFIGS:
            print(f"unknown config {name!r}; accepted: {', '.join(CONFIGS)}", file=sys.stderr)
            return 2
    TURNS = args.turns
    rng = np.random.default_rng(0)
    print(f"{args.prompts} prompts x {args.n} sessions, prompt <= {args.prompt_len} tokens, {args.turns} turns x "
          f"{args.turn_tokens} tokens, {args.obs_tokens}-token observations; median of {args.repeats} after two warm-ups")
    print(f"{'config':7s} {'tool ms':>7s} {'path':10s} {'wall s':>8s} {'s/turn':>8s} {'prefilled':>9s} "
          f"{'prefill+ext calls':>17s} {'reprefill/kv':>12s} {'same tokens':>11s}")
    for name in args.configs.split(","):
        cfg = CONFIGS[name]()
        params = F.init_params(cfg, seed=0)[1]
        total = args.prompts * args.n
        response = args.turns * args.turn_tokens + (args.turns - 1) * args.obs_tokens
        engine = RljaxEngine(cfg, num_slots=total, max_prefill_length=args.prompt_len + response,
                             max_decode_length=response, prefill_batch_size=min(total, 64))
        sampler = Sampler(engine, params, steps_per_sync=16)
        prompts = [Prompt(tuple(int(t) for t in rng.integers(6, cfg.vocab_size, rng.integers(args.prompt_len // 2,
                                                                                          args.prompt_len + 1))))
                   for _ in range(args.prompts)]
        for ms in [float(x) for x in args.tool_ms.split(",")]:
            env_cls = make_env(args.obs_tokens, ms)
            rows = {}
            for path in ("kv", "reprefill"):
                for _ in range(2):  # compile (tools finish in a different order each run: row buckets vary)
                    run(sampler, prompts, args, path, env_cls)
                runs = [run(sampler, prompts, args, path, env_cls) for _ in range(args.repeats)]
                wall = statistics.median(r[0] for r in runs)
                rows[path] = (wall, runs[0][1], runs[0][2])
            ref = rows["kv"][2].response_ids
            for path in ("kv", "reprefill"):
                wall, d, traj = rows[path]
                same = float((np.asarray(traj.response_ids) == np.asarray(ref)).mean())
                ratio = rows["reprefill"][0] / wall
                print(f"{name:7s} {ms:7.0f} {path:10s} {wall:8.3f} {wall / args.turns:8.3f} "
                      f"{d['prefill_tokens'] + d['extended_tokens']:9d} "
                      f"{d['prefill_calls']:>8d}+{d['extend_calls']:<8d} {ratio:11.2f}x {same:11.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
