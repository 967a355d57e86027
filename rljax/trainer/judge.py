"""The generative judge (``reward.judge``): a causal language model that reads each trajectory and
answers with a verdict, which ``reward.judge.parse`` turns into a reward.

It is a client of the rollout engine like the policy's sampler: an :class:`~rljax.rollout.RljaxEngine`
and :class:`~rljax.rollout.Sampler` of its own (the public API only), on the policy sampler's
devices and layout (``rollout.tp``), greedy by default (``reward.judge.temperature=0``). One
``generate`` call per step judges every real row of the batch, so the engine batches them across
its slots as it batches the policy's rollouts. With several processes each judges the rows it
holds (its share of the batch; greedy, or with the rows' own ``(seed, uid, session)`` random
streams, so the verdicts are the one-process run's) and ``gather_rollout`` merges the reports
(:func:`rljax.trainer.distribute.merge_judge_reports`). In the synchronous step it runs as the
``reward_judge`` stage, after ``trajectory_fields`` and before ``reward``, which combines its
scores (``reward.combine.judge_weight``).

``reward.judge.path=ref`` judges with the policy's initial weights (the reference model: the
``model.path`` checkpoint or the seeded preset, a LoRA run's frozen base); a directory is a
Hugging Face ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` checkpoint with its own
``tokenizer.json`` (without one, the policy's tokenizer, whose ids must fit its vocabulary).
The judge's weights stay installed for the whole run (a second copy of a model on the sampler
devices); they never change.

What a row's judge reads: ``prompt_template`` with ``{prompt}`` (the task prompt as text; a
chat prompt as the policy saw it, template applied), ``{response}`` (the policy's response,
special tokens dropped) and ``{answer}`` (the ground truth), tokenized with BOS. An input
longer than ``reward.judge.prompt_length`` keeps its end (where the verdict is asked for) and is
counted in ``reward/judge/prompt_truncated``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional

import numpy as np

from rljax.models import functional as F
from rljax.models.hf import load_hf_checkpoint
from rljax.reward import judge_prompt, load_judge_parse, parse_verdicts
from rljax.rollout import DecodeParams, RljaxEngine, Sampler, sampler_mesh
from rljax.tokenizer import load_tokenizer


@dataclasses.dataclass
class Judge:
    """A loaded judge: its sampler, tokenizer, parser and decoding (see the module docstring)."""

    sampler: Any
    tokenizer: Any
    parse: Callable[[str], Optional[float]]
    template: str
    decode: Any  # DecodeParams
    prompt_length: int

    @classmethod
    def from_config(cls, cfg, *, policy_config, policy_tokenizer, devices, initial_params: Callable[[], Any],
                    rows: Optional[int] = None) -> "Judge":
        """Builds the judge of ``cfg.reward.judge``.

        Args:
          policy_config: the policy's :class:`rljax.models.ModelConfig` (``path=ref`` judges with it).
          policy_tokenizer: the policy's tokenizer (the responses' text; a judge checkpoint
            without ``tokenizer.json`` reads with it).
          devices: the policy sampler's devices (the judge's engine uses the same layout).
          initial_params: ``() -> params``: the policy's initial weights (called for ``path=ref``).
          rows: the most rows one call judges (the engine's slots unless ``rollout.max_slots``
            is set; default the whole batch: several processes pass their share).

        Raises:
          ValueError: a judge vocabulary smaller than its tokenizer's, or inputs plus verdicts
            longer than the judge's ``max_position_embeddings``.
        """
        j, d = cfg.reward.judge, cfg.data
        mesh = sampler_mesh(cfg.rollout.tp, devices)
        if j.path == "ref":
            config, params, tokenizer = policy_config, initial_params(), policy_tokenizer
        else:
            # read onto the judge's own (process-local) devices: on several processes the default
            # placement, the first global device, is another process's
            config, params = load_hf_checkpoint(j.path, dtype=cfg.model.dtype, mesh=mesh)
            tokenizer = policy_tokenizer
            if os.path.isfile(os.path.join(j.path, "tokenizer.json")):
                tokenizer = load_tokenizer(j.path)
            if tokenizer.vocab_size > config.vocab_size:
                raise ValueError(f"reward.judge.path={j.path} has a vocabulary of {config.vocab_size} tokens, its "
                                 f"tokenizer {tokenizer.vocab_size} (without a tokenizer.json there the judge reads "
                                 "with the policy's tokenizer)")
        overhead = len(tokenizer.encode(j.prompt_template.format(prompt="", response="", answer=""), add_bos=True))
        prompt_length = j.prompt_length or d.max_prompt_length + d.max_response_length + overhead
        if prompt_length + j.response_length > config.max_position_embeddings:
            raise ValueError(f"the judge's inputs and verdicts need {prompt_length} + {j.response_length} positions "
                             f"(reward.judge.prompt_length + reward.judge.response_length), more than its "
                             f"max_position_embeddings={config.max_position_embeddings}; set reward.judge.prompt_length")
        rows = cfg.rollout.max_slots or rows or d.train_batch_size * cfg.rollout.n
        engine = RljaxEngine(config, num_slots=rows, max_prefill_length=prompt_length,
                             max_decode_length=j.response_length, mesh=mesh,
                             prefill_batch_size=min(rows, 64))
        sampler = Sampler(engine, params, version=0, truncation="left")
        decode = DecodeParams(max_new_tokens=j.response_length, temperature=j.temperature, seed=cfg.trainer.seed,
                              eos_ids=(tokenizer.eos_id,))
        return cls(sampler=sampler, tokenizer=tokenizer, parse=load_judge_parse(j.parse), template=j.prompt_template,
                   decode=decode, prompt_length=prompt_length)

    def inputs(self, traj, prompts, *, policy_tokenizer) -> list[str]:
        """The judge's input text of each row (``""`` on padding rows)."""
        out = []
        for i in range(traj.batch_size):
            if traj.is_padding[i]:
                out.append("")
                continue
            p = prompts[int(traj.group_id[i])]
            prompt = p.prompt if isinstance(p.prompt, str) else policy_tokenizer.decode(p.ids)
            response = policy_tokenizer.decode(traj.response_ids[i, : int(traj.response_length[i])])
            out.append(judge_prompt(self.template, prompt=prompt, response=response, answer=p.answer))
        return out

    def __call__(self, traj, prompts, *, policy_tokenizer, max_error_fraction: float) -> dict:
        """Judges every real row of ``traj``: ``{"judge_scores": [B] float32 (0 on padding),
        "judge_texts": per-row verdict text, "judge_status": per-row ok / unparseable / error,
        "judge_report": JudgeReport}``.

        Raises:
          RewardError: errors plus unparseable verdicts over ``max_error_fraction`` of the rows.
        """
        texts = self.inputs(traj, prompts, policy_tokenizer=policy_tokenizer)
        real = np.nonzero(~np.asarray(traj.is_padding))[0]
        ids = [self.tokenizer.encode(texts[i], add_bos=True) for i in real]
        cut = sum(len(x) > self.prompt_length for x in ids)
        keys = [f"{traj.uid[i]}_{traj.session[i]}_{traj.index[i]}" for i in range(traj.batch_size)]
        out = self.sampler.generate(ids, uids=[keys[i] for i in real], n=1, decode=self.decode)
        verdicts = [""] * traj.batch_size
        truncated = np.zeros(traj.batch_size, bool)
        for k, i in enumerate(real):
            verdicts[i] = self.tokenizer.decode(out.response_ids[k, : int(out.response_length[k])])
            truncated[i] = bool(out.truncated[k])
        scores, status, report = parse_verdicts(self.parse, verdicts, keys, max_error_fraction=max_error_fraction,
                                                is_padding=traj.is_padding, truncated=truncated, prompt_truncated=cut)
        return {"judge_scores": scores, "judge_texts": tuple(verdicts), "judge_status": tuple(status),
                "judge_report": report}


def initial_policy_params(cfg, config, mesh):
    """The policy's initial weights, rebuilt as the trainer built them: the ``model.path``
    checkpoint, or the preset ``config`` initialised with ``trainer.seed`` on ``mesh`` (a LoRA
    run's base: the adapters are not part of it)."""
    if cfg.model.path:
        return load_hf_checkpoint(cfg.model.path, dtype=cfg.model.dtype, mesh=mesh)[1]
    return F.init_params(config, seed=cfg.trainer.seed, mesh=mesh)[1]


def judge_metrics(scores, report, real) -> dict:
    """``reward/judge/{mean,max,min}`` of the real rows' verdict scores and the report's counts."""
    s = np.asarray(scores, np.float32)[np.asarray(real, bool)]
    out = {"reward/judge/mean": float(s.mean()), "reward/judge/max": float(s.max()),
           "reward/judge/min": float(s.min())} if s.size else {}
    return {**out, **report.metrics()}
