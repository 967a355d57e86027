"""Misused policy-loss and rollout-correction keys: each is a usage error from a real launch
process, exit 2, one line naming the key and what is accepted, before JAX is imported and
before anything is written."""

import json
import subprocess
import sys

from launching import REPO, launch_env

RC = "algorithm.rollout_correction"
#: (case, overrides, fragment of the one line)
MISTAKES = [
    ("unknown loss", ["actor.policy_loss=ppo3"],
     "actor.policy_loss='ppo3' is not accepted; accepted: vanilla, gspo, cispo, dppo_tv, dppo_kl, sapo, gpg, clip_cov, "
     "kl_cov, geo_mean, dro, bypass_mode"),
    ("threshold not a number", [f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=abc"],
     "rollout_is_threshold='abc' is not a number"),
    ("icepop bounds reversed", [f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=5_0.5"],
     "the lower bound must be <= the upper bound"),
    ("icepop bound not positive", [f"{RC}.rollout_is=sequence", f"{RC}.rollout_is_threshold=0_2"],
     "must be a positive finite number"),
    ("unknown rs option", [f"{RC}.rollout_rs=token_k9", f"{RC}.rollout_rs_threshold=1"],
     "unknown rollout_rs option 'token_k9'; accepted: token_k1, token_k2, token_k3, seq_sum_k1"),
    ("seq_max_k1 is not an option", [f"{RC}.rollout_rs=seq_max_k1", f"{RC}.rollout_rs_threshold=2"],
     "unknown rollout_rs option 'seq_max_k1'"),
    ("rs without threshold", [f"{RC}.rollout_rs=seq_mean_k3"], "needs rollout_rs_threshold"),
    ("k3 given two bounds", [f"{RC}.rollout_rs=seq_mean_k3", f"{RC}.rollout_rs_threshold=0.5_2.0"],
     "seq_mean_k3='0.5_2.0': seq_mean_k3 takes one upper bound"),
    ("threshold count", [f"{RC}.rollout_rs=token_k1,seq_sum_k2,seq_max_k3", f"{RC}.rollout_rs_threshold=0.5_2,1"],
     "gives 2 thresholds for 3 rollout_rs options"),
    ("rs threshold garbage", [f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold=0.5_x"], "'x' is not a number"),
    ("sapo option without sapo", ["actor.tau_pos=2.0"], "actor.tau_pos=2.0 is set, but"),
    ("dro without beta", ["actor.policy_loss=dro"], "actor.policy_loss=dro needs actor.dro_beta"),
    ("bypass loss without bypass", ["actor.policy_loss=bypass_mode"], "needs algorithm.bypass_mode=true"),
    ("two IS spellings", ["rollout.correction=token", f"{RC}.rollout_is=token"], "both set the importance weights"),
    ("bypass correction with gspo", ["algorithm.bypass_mode=true", "actor.policy_loss=gspo",
                                     f"{RC}.rollout_rs=seq_mean_k3", f"{RC}.rollout_rs_threshold=0.01"],
     "not actor.policy_loss=gspo"),
    ("loss_type without bypass", [f"{RC}.loss_type=reinforce"], "loss_type='reinforce' is set, but algorithm.bypass_mode=false"),
]

CHILD = """
import contextlib, io, json, pathlib, sys
from rljax.launch import main
tmp, cases = pathlib.Path(sys.argv[1]), json.loads(sys.argv[2])
out = {}
for case, args in cases:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["--run-dir", str(tmp / "run"), *args])
    out[case] = [code, err.getvalue()]
heavy = [m for m in ("jax", "tensorflow", "flax") if m in sys.modules]
print(json.dumps({"out": out, "heavy": heavy}))
"""


def test_misused_loss_and_correction_keys_exit_2_in_one_line(tmp_path):
    cases = [[case, args] for case, args, _ in MISTAKES]
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), json.dumps(cases)], cwd=REPO,
                          env=launch_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for case, _, fragment in MISTAKES:
        code, err = report["out"][case]
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and fragment in lines[0], (case, code, err)
    assert report["heavy"] == [], report
    assert not (tmp_path / "run").exists()
