"""The GPU check's one-shot runner on CPU (bench/gpu.py --cpu-smoke): every section's code path, each in its own
process as on a GPU machine, so that nothing fails there for a reason a CPU can show. And the runner's own
promises: a clean environment for each section, a line per section even when one runs past its limit."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, job_env

from bench import gpu
from bench import gpu_model

pytestmark = pytest.mark.slow  # (tests/README.md: the editing loop's subset leaves it out)


def _run(out, *args, **env):
    e = job_env(**env)
    return subprocess.run([sys.executable, "-m", "bench.gpu", "--cpu-smoke", f"--out={out}", *args],
                          cwd=ROOT, env=e, capture_output=True, text=True, timeout=1800)


def test_every_section_passes_on_cpu(tmp_path):
    # launcher variables in the parent's environment must not reach the sections (they start process groups and
    # train.py runs of their own: an inherited MASTER_PORT was EADDRINUSE)
    r = _run(tmp_path, MASTER_PORT="1", RANK="3", WORLD_SIZE="7", LOCAL_RANK="3")
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0 and summary["ok"], (summary.get("status"), r.stdout[-4000:], r.stderr[-4000:])
    names = [n for n, _ in gpu.SECTIONS]
    lines = [json.loads(x) for x in open(tmp_path / "gpu_check.jsonl")]
    assert [x["section"] for x in lines] == names and all(x["ok"] for x in lines)
    assert summary["status"] == {n: "ok" for n in names}
    assert json.load(open(tmp_path / "gpu_check_summary.json"))["ok"]
    by = {x["section"]: x for x in lines}
    assert by["self_ring"]["vias"] == ["copy"] and by["self_p2p"]["supported"] is False  # gloo: no send to self
    assert by["big_blocks"]["encoder"]["head_dim"] == 104 and by["big_blocks"]["decoder"]["head_dim"] == 32
    # the whole-model sections ran at the head layouts they name, and measured every block
    for name, heads in gpu_model.SMOKE_HEADS.items():
        assert by[name]["heads"] == [heads["heads"], heads["dec_heads"]], (name, by[name])
        assert [len(by[name]["stacks"][s]["block_bwd_ms"]) for s in ("encoder", "decoder")] == [4, 2], by[name]
    assert by["rank_step"]["W"] == 8 and by["rank_step"]["ckpt_blocks"]["encoder"], by["rank_step"]
    assert all(by["data_copy"][c][p]["values_right"] for c in ("quickstart", "base_102k", "big_context rank")
               for p in ("old", "new", "pageable"))


def test_a_section_past_its_limit_costs_only_itself(tmp_path):
    # a section that runs past its limit is killed (its whole process group: the torchrun runs it started too) and
    # gets its line from the runner; the sections after it still run. The memory section is held still (SIGSTOP to
    # its group) once its ranks are up, so that the limit decides, not how fast this machine runs it
    p = subprocess.Popen([sys.executable, "-m", "bench.gpu", "--cpu-smoke", f"--out={tmp_path}",
                          "--only=env,memory,ops", "--limit_s=8"], cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    deadline, ranks = time.time() + 120, []
    while not ranks and time.time() < deadline and p.poll() is None:
        ranks = subprocess.run(["pgrep", "-f", "bench.plan _memory_worker"], capture_output=True,
                               text=True).stdout.split()
        time.sleep(0.05)
    section = subprocess.run(["pgrep", "-f", f"bench.gpu --section=memory --out={tmp_path}"], capture_output=True,
                             text=True).stdout.split()
    assert ranks and section, p.communicate()
    os.killpg(int(section[0]), signal.SIGSTOP)  # (its own group, its ranks in it: the runner starts it in a session)
    stdout, _ = p.communicate(timeout=600)
    lines = {x["section"]: x for x in map(json.loads, open(tmp_path / "gpu_check.jsonl"))}
    assert p.returncode == 1 and json.loads(stdout.strip().splitlines()[-1])["status"]["memory"] == "FAIL"
    assert not lines["memory"]["ok"] and "timed out after 8 s" in lines["memory"]["error"]
    left = subprocess.run(["pgrep", "-f", "bench.plan _memory_worker"], capture_output=True, text=True).stdout
    assert not left, f"the killed section's ranks outlived it: {left}"
    assert lines["env"]["ok"] and lines["ops"]["ok"]


def test_the_budgets_end_cuts_or_skips_a_section_and_fails_none(tmp_path):
    # a section the budget's end stops is "cut (budget)", one it leaves no time for "skipped (budget)": listed, not
    # failures. The section to cut is held still as soon as it starts (SIGSTOP to its process group: it is alive,
    # and not done, when the budget ends), so that the budget's end decides, not how fast this machine runs it. 25 s:
    # env's few seconds leave elastic more than the 15 s below which the runner skips a section
    out = tmp_path / "cut"
    p = subprocess.Popen([sys.executable, "-m", "bench.gpu", "--cpu-smoke", f"--out={out}", "--only=env,elastic",
                          "--budget_s=25"], cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    deadline, section = time.time() + 60, []
    while not section and time.time() < deadline and p.poll() is None:
        section = subprocess.run(["pgrep", "-f", f"bench.gpu --section=elastic --out={out}"], capture_output=True,
                                 text=True).stdout.split()
        time.sleep(0.05)
    assert section, p.communicate()
    os.killpg(int(section[0]), signal.SIGSTOP)  # (its own group: the runner starts each section in a new session)
    stdout, stderr = p.communicate(timeout=120)
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["status"] == {"env": "ok", "elastic": "cut (budget)"}, (summary, stderr[-3000:])
    assert p.returncode == 0 and summary["ok"] and "the budget's end" in summary["sections"]["elastic"]["error"]
    assert not subprocess.run(["pgrep", "-f", f"--section=elastic --out={out}"], capture_output=True).stdout
    r = _run(tmp_path / "skip", "--only=ops", "--budget_s=10")
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0 and summary["ok"] and summary["status"] == {"ops": "skipped (budget)"}, summary
