"""The 31.6M GRPO update, rljax vs plain torch (what TRL's GRPOTrainer runs), in one process, interleaved.

    python bench/peer_update_torch.py                 # B=64 trajectories of 8 + 32 tokens, 5 rounds
    PROFILE=1 python bench/peer_update_torch.py       # + where each side's update time goes, by category
    GC=0 python bench/peer_update_torch.py            # torch without gradient checkpointing
    ONLY=torch python bench/peer_update_torch.py      # torch alone in the process
    OLD=1 python bench/peer_update_torch.py           # + rljax with its projections as 3-D einsums (before)
    THREADS=1 taskset -c 1 python bench/peer_update_torch.py   # one core each (robust to load)
    T=256 B=64 R=1 python bench/peer_update_torch.py  # the 31m-256 case's update
    TRIM=1 PAD=3 python bench/peer_update_torch.py    # + both on the batch without its all-padding prompt
                                                      #   columns (data.trim_prompt_padding; TRL pads to the longest)
    REMAT=minimal TRIM=1 PAD=3 python bench/peer_update_torch.py  # + rljax with model.remat on, policy minimal
                                                      #   (REMAT=1: full) on the trimmed batch: what the trainer
                                                      #   now runs at 31.6M (model.remat=auto)

Both sides start from the same weights (rljax's ``init_params`` written with
``save_hf_checkpoint``, read by ``transformers``' ``Qwen2ForCausalLM``) and take one
optimizer step on the same batch: log-probs of the response tokens only (TRL's
``logits_to_keep``; rljax slices the hidden states before the unembedding), the clipped
GRPO loss with ``old = current.detach()`` (on-policy, as both skip the old-log-prob pass),
token-mean, gradient clipping at 1.0, AdamW. torch runs as TRL runs it: float32, gradient
checkpointing on (``GC=0`` off), SDPA attention, its default 2 threads. The step's loss and
gradient norm are printed for both (equal work: they agree to float32 tolerance).

Times: ``R`` rounds, each side once per round in turn; medians of wall and process CPU
time, and the ratio rljax / torch. With ``PROFILE=1`` one more step of each runs under its
profiler (``jax.profiler`` trace; ``torch.profiler``) and the time is summed by category:
``OLD=1`` adds rljax with
``rljax.models.transformer.FLATTEN_TOKEN_DOTS`` off (``rljax-einsum``, the projections as
3-D einsums, as before this bench) to the rotation. ``THREADS=1`` sets torch to one thread
(run under ``taskset -c N``: XLA then sizes its pool to the one CPU too).

Profile categories: the dots of the MLP / attention projections (forward, backward), attention itself, the LM
head and log-softmax, elementwise and layout work (transposes, copies), the optimizer, other.
"""

import collections
import gzip
import glob
import json
import os
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from _peer_update import PAD, PROMPT, actor_batch, model_31m, trimmed
from rljax.models import functional as F
from rljax.models.hf import save_hf_checkpoint
from rljax.trainer import step as S

T = int(os.environ.get("T", 32))
B = int(os.environ.get("B", 64))
R = int(os.environ.get("R", 5))
GC = os.environ.get("GC", "1") == "1"
LR = 3e-4
CLIP_LOW, CLIP_HIGH = 0.2, 0.28


# --------------------------------------------------------------------------- rljax side


def rljax_step(cfg, g=None, p=None):
    if g is None:
        g, p = F.init_params(cfg, seed=0)
    sc = S.StepConfig(ppo_mini_batch_size=B, ppo_micro_batch_size=B, on_policy=True, shuffle=False,
                      clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH)
    opt = S.make_optimizer(lr=LR, betas=(0.9, 0.99))
    step = S.make_train_step(g, opt, sc)
    return g, p, step, opt


# --------------------------------------------------------------------------- torch side


def torch_model(cfg, params):
    import torch
    import transformers

    d = tempfile.mkdtemp(prefix="peer_update_torch_")
    save_hf_checkpoint(d, cfg, params)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    if GC:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def torch_step_fn(model, batch, prompt=PROMPT):
    """One TRL-style update: forward with logits only at response positions, selective
    log-softmax, clipped GRPO loss (dapo = token-mean), backward, clip, AdamW."""
    import torch

    ids = torch.from_numpy(np.asarray(batch["input_ids"])).long()
    mask = torch.from_numpy(np.asarray(batch["attention_mask"])).long()
    pos = torch.from_numpy(np.asarray(batch["positions"])).long()
    adv = torch.from_numpy(np.asarray(batch["advantages"]))
    loss_mask = torch.from_numpy(np.asarray(batch["loss_mask"]))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=0.0)

    def step():
        out = model.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
        hidden = out.last_hidden_state[:, prompt - 1:-1]  # logits_to_keep: response positions only
        logits = model.lm_head(hidden)
        logp = torch.gather(torch.log_softmax(logits, -1), -1, ids[:, prompt:, None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())
        loss1 = ratio * adv
        loss2 = torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH) * adv
        loss = (-torch.min(loss1, loss2) * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss), float(norm)

    return step


# --------------------------------------------------------------------------- profiles by category


def _category(op_name: str, name: str) -> str:
    side = "bwd" if "transpose(jvp" in op_name else "fwd"
    if "jvp" not in op_name:  # outside the differentiated loss: clipping, AdamW, metrics
        return "optimizer / clip / metrics"
    if re.search(r"btkgd|bkgts|softmax|attention", op_name):
        return f"attention core {side}"
    if name.startswith(("ynn_fusion", "dot")):
        return f"dots (projections) {side}"
    if re.search(r"logprob|log_softmax|logsumexp|lm_head|unembed", op_name):
        return f"LM head / log-softmax {side}"
    if "broadcast" in name or "dynamic-update-slice" in name or "dynamic-slice" in name:
        return "scan stacks (layer residuals / weights)"
    if "transpose" in name or "copy" in name:
        return f"transposes / copies {side}"
    return f"elementwise / norm / rope {side}"


def jax_profile(step, state, batch, key, hlo_text: str) -> dict:
    meta = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name=\"([^\"]*)\"", line)
        if m:
            meta.setdefault(m.group(1), m.group(2))
    d = tempfile.mkdtemp(prefix="peer_update_jax_trace_")
    with jax.profiler.trace(d, create_perfetto_trace=True):
        state, m = step(state, batch, key)
        jax.block_until_ready(m)
    f = sorted(glob.glob(d + "/**/*.trace.json.gz", recursive=True), key=os.path.getmtime)[-1]
    ev = json.load(gzip.open(f))
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    cats = collections.Counter()
    for e in ev:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        n = e["name"]
        if n in meta:
            cats[_category(meta[n], n)] += e["dur"] / 1e6
    return cats, state


def torch_profile(step) -> dict:
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    cats = collections.Counter()
    for e in prof.key_averages():
        n = e.key
        s = e.self_cpu_time_total / 1e6
        if n in ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul"):
            cats["dots (all linear layers, fwd + bwd + recompute)"] += s
        elif "scaled_dot_product" in n or "flash_attention" in n or "_efficient_attention" in n:
            cats["attention core (SDPA)"] += s
        elif "log_softmax" in n or n == "aten::gather":
            cats["LM head / log-softmax"] += s
        elif "adam" in n.lower() or "_foreach" in n or "Optimizer" in n:
            cats["optimizer"] += s
        elif n in ("aten::copy_", "aten::clone", "aten::contiguous", "aten::t", "aten::transpose", "aten::cat"):
            cats["copies / transposes"] += s
        else:
            cats["elementwise / norm / rope / other"] += s
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
    return cats, [(e.key, e.count, e.self_cpu_time_total / 1e6) for e in top]


# --------------------------------------------------------------------------- main


def main():
    import torch

    from rljax.models import transformer

    if os.environ.get("THREADS"):
        torch.set_num_threads(int(os.environ["THREADS"]))
    cfg = model_31m()
    g, p, jstep, opt = rljax_step(cfg)
    model = torch_model(cfg, p)
    batch = actor_batch(B, T)
    tstep = torch_step_fn(model, batch)
    key = jax.random.key(0)
    runs = {}

    def rljax_runner(name, step, flat, batch=batch):
        state = S.init_state(jax.tree.map(jnp.copy, p), opt)
        transformer.FLATTEN_TOKEN_DOTS = flat  # read while tracing (the first call)
        t = time.perf_counter()
        state, m = step(state, batch, key)
        jax.block_until_ready(m)
        transformer.FLATTEN_TOKEN_DOTS = True
        print(f"{name} first step (compile + run) {time.perf_counter() - t:.1f} s: loss {float(m['loss']):.6f}, "
              f"grad norm {float(m['grad_norm']):.6f}")
        box = [state]

        def run():
            box[0], m = step(box[0], batch, key)
            jax.block_until_ready(m)

        return run, box

    only = os.environ.get("ONLY")  # "torch": time torch alone (no XLA thread pool in the process's way)
    box = [None]
    if only != "torch":
        runs["rljax"], box = rljax_runner("rljax", jstep, True)
    if os.environ.get("OLD") and only != "torch":
        runs["rljax-einsum"], _ = rljax_runner("rljax-einsum", rljax_step(cfg, g, p)[2], False)
    if os.environ.get("TRIM") and only != "torch":  # data.trim_prompt_padding: the same update on PROMPT-PAD columns
        runs["rljax-trim"], _ = rljax_runner("rljax-trim", rljax_step(cfg, g, p)[2], True, trimmed(batch))
    if os.environ.get("REMAT") and only != "torch":  # model.remat on (the same parameters)
        policy = "minimal" if os.environ["REMAT"] == "minimal" else "full"
        name = f"rljax-remat-{policy}" + ("-trim" if os.environ.get("TRIM") else "")
        rcfg = cfg.replace(remat=True, remat_policy=policy)
        runs[name], _ = rljax_runner(name, rljax_step(rcfg, F.abstract_params(rcfg)[0], p)[2], True,
                                     trimmed(batch) if os.environ.get("TRIM") else batch)
    loss, norm = tstep()
    print(f"torch first step: loss {loss:.6f}, grad norm {norm:.6f}  (gradient checkpointing {'on' if GC else 'off'}, "
          f"{torch.get_num_threads()} threads)")
    runs["torch"] = tstep
    if os.environ.get("TRIM"):  # TRL pads prompts to the batch's longest: its work is the trimmed batch's
        ttrim = torch_step_fn(torch_model(cfg, p), trimmed(batch), PROMPT - PAD)
        loss, norm = ttrim()
        print(f"torch-trim first step: loss {loss:.6f}, grad norm {norm:.6f}")
        runs["torch-trim"] = ttrim

    times = {k: [] for k in runs}
    for _ in range(R):
        for side, fn in runs.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            times[side].append((time.perf_counter() - t, time.process_time() - c))
    med = {s: (np.median([w for w, _ in v]), np.median([c for _, c in v])) for s, v in times.items()}
    for s, (w, c) in med.items():
        prompt = PROMPT - PAD if s.endswith("-trim") else PROMPT
        tokens = B * (prompt + T)
        print(f"B={B} {prompt}+{T} tokens  {s:<12} wall {w:.3f} s  cpu {c:.3f} s  ({tokens / w:.0f} tokens/s)  "
              f"/ torch: wall {w / med['torch'][0]:.2f}x  cpu {c / med['torch'][1]:.2f}x")
    print(f"load {os.getloadavg()[0]:.1f}", flush=True)
    state = box[0]

    if os.environ.get("PROFILE") and only != "torch":
        hlo = jstep.lower(state, batch, key).compile().as_text()
        jc, state = jax_profile(jstep, state, batch, key, hlo)
        tc, top = torch_profile(tstep)
        print("\nrljax update by category (thunk time, seconds):")
        for k, v in sorted(jc.items(), key=lambda kv: -kv[1]):
            print(f"  {v:8.3f}  {k}")
        print(f"  {sum(jc.values()):8.3f}  total")
        print("\ntorch update by category (self CPU time, seconds; 2 threads count once):")
        for k, v in sorted(tc.items(), key=lambda kv: -kv[1]):
            print(f"  {v:8.3f}  {k}")
        print(f"  {sum(tc.values()):8.3f}  total")
        print("\ntorch top ops (self CPU):")
        for n, c, s in top:
            print(f"  {s:8.3f}  {c:5d}  {n}")


if __name__ == "__main__":
    main()
