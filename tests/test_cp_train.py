"""train.py with context parallelism: cp runs follow the cp = 1 trajectory; bad CP input fails early."""
import pytest

import configurator
import model as M
from conftest import job_env, read_log, read_val, run_train, small_args


def _losses(d):
    return [r["loss"] for r in read_log(d)]


def _same(a, b, tol=1e-5):
    assert len(a) == len(b) and len(a) > 0
    for x, y in zip(a, b):
        assert abs(x - y) <= tol * abs(x), (a, b)


def test_ten_steps_cp2_match_cp1(small_store, tmp_path):
    # cp = 1 with mask_strata = 2 draws exactly the masks that cp = 2 draws (strata, not ranks, set them)
    one = run_train(small_args(small_store, tmp_path / "cp1", max_steps=10, mask_strata=2), nproc=1)
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_train(small_args(small_store, tmp_path / "cp2", max_steps=10, cp=2), nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "dp 1 x cp 2 (ring)" in two.stdout
    _same(_losses(tmp_path / "cp1"), _losses(tmp_path / "cp2"))
    # the held-out loss too, at steps 0, 3, 6, 9 and 10: every rank takes part, each holding a slab of each sample
    v1, v2 = read_val(tmp_path / "cp1"), read_val(tmp_path / "cp2")
    assert [s for s, _ in v1] == [s for s, _ in v2] == [0, 3, 6, 9, 10]
    _same([v for _, v in v1], [v for _, v in v2])


@pytest.mark.slow
@pytest.mark.parametrize("cp,extra", [(2, {}), (3, {"crop": (24, 16, 32), "val_frac": 0.5})])
def test_torch_cp_trains_like_one_rank_and_the_ring(small_store, tmp_path, cp, extra):
    # cp_impl='torch' (PyTorch's own ring functions, forward and backward) follows the one-rank run and our ring
    args = dict(max_steps=6, eval_interval=5, **extra)
    one = run_train(small_args(small_store, tmp_path / "one", mask_strata=cp, **args), nproc=1)
    assert one.returncode == 0, one.stderr[-3000:]
    runs = {}
    for impl in ("torch", "ring"):
        runs[impl] = run_train(small_args(small_store, tmp_path / impl, cp=cp, cp_impl=impl, **args), nproc=cp)
        assert runs[impl].returncode == 0, runs[impl].stderr[-3000:]
        assert f"dp 1 x cp {cp} ({impl})" in runs[impl].stdout
        _same(_losses(tmp_path / "one"), _losses(tmp_path / impl))
        _same([v for _, v in read_val(tmp_path / "one")], [v for _, v in read_val(tmp_path / impl)])
    _same(_losses(tmp_path / "ring"), _losses(tmp_path / "torch"), tol=1e-6)


@pytest.mark.slow
def test_dp2_x_cp2_matches_one_rank(small_store, tmp_path):
    one = run_train(small_args(small_store, tmp_path / "a", max_steps=5, micro_batch=4, mask_strata=2), nproc=1)
    assert one.returncode == 0, one.stderr[-3000:]
    four = run_train(small_args(small_store, tmp_path / "b", max_steps=5, micro_batch=2, cp=2), nproc=4)
    assert four.returncode == 0, four.stderr[-3000:]
    assert "dp 2 x cp 2" in four.stdout
    _same(_losses(tmp_path / "a"), _losses(tmp_path / "b"))
    _same([v for _, v in read_val(tmp_path / "a")], [v for _, v in read_val(tmp_path / "b")])  # dp 2 x cp 2 share 3


@pytest.mark.parametrize("extra,nproc,expect", [
    (["--crop=(24,16,32)", "--cp=3"], 2, "world size 2 is not divisible by cp=3"),
    (["--crop=(24,16,32)", "--cp=2"], 2, "cannot be split evenly over cp=2"),
])
def test_bad_cp_input_fails_before_training(small_store, tmp_path, extra, nproc, expect):
    r = run_train(small_args(small_store, tmp_path) + extra, nproc=nproc)
    assert r.returncode != 0
    assert expect in r.stderr, r.stderr[-3000:]
    assert "error: " in r.stderr
    assert not (tmp_path / "log.jsonl").exists()


@pytest.mark.slow
def test_bad_input_is_rank_0s_line_even_when_rank_0_is_the_last_to_find_it(small_store, tmp_path):
    """Rank 0 reaches the config check 3 s after rank 1 (a lagging start): torchrun ends every rank once one exits,
    and rank 0 alone says why, so rank 1 waits for that; the line is there, said once, and nothing was written."""
    r = run_train(small_args(small_store, tmp_path) + ["--crop=(24,16,32)", "--cp=2"], nproc=2,
                  script="tests/train_hooks.py", env=job_env(MAE_FAULT="slow_check:0:3"))
    assert r.returncode != 0
    said = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    assert len(said) == 1 and "cannot be split evenly over cp=2" in said[0], r.stderr[-3000:]
    assert not (tmp_path / "log.jsonl").exists()


def test_unsupported_head_dim_is_a_startup_error(monkeypatch):
    # a researcher's new size with 10-wide heads: fine for plain SDPA, not for the fused ring kernels
    monkeypatch.setitem(M.SIZES, "odd", (60, 1, 6, 32, 1, 4))  # (dim, depth, heads, dec_dim, dec_depth, dec_heads)
    cfg = configurator.defaults()
    cfg.update(model_size="odd", crop=(32, 32, 32), patch=(8, 8, 8))
    configurator.check_config(cfg)  # cp = 1: plain SDPA takes any head dim
    cfg["cp"] = 2
    with pytest.raises(configurator.ConfigError, match="head dim 10 is unsupported"):
        configurator.check_config(cfg)
