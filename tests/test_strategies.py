"""zero2, zero3 and fsdp2: the same gradient semantics (same loss trajectory) and each resumes from its own
checkpoints."""
import pytest

import checkpoint
from conftest import read_log, run_train, small_args


@pytest.fixture(scope="module")
def zero2_reference(small_store, tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    r = run_train(small_args(small_store, d, max_steps=5, grad_accum=2), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    return [x["loss"] for x in read_log(d)]


@pytest.mark.parametrize("strategy", ["zero2", "zero3", "fsdp2"])
def test_strategy_matches_zero2_and_resumes_from_its_own_checkpoint(strategy, small_store, tmp_path, zero2_reference):
    args = dict(max_steps=5, grad_accum=2, strategy=strategy)
    a = run_train(small_args(small_store, tmp_path, stop_step=3, **args), nproc=2)  # steps 0-2, checkpoint, stop
    assert a.returncode == 0, a.stderr[-3000:]
    assert [s for s, _ in checkpoint.complete_checkpoints(str(tmp_path / "ckpt"))] == [3]
    b = run_train(small_args(small_store, tmp_path, **args), nproc=2)  # resumes: steps 3-4
    assert b.returncode == 0, b.stderr[-3000:]
    assert "resumed from" in b.stdout
    losses = [x["loss"] for x in read_log(tmp_path)]
    assert len(losses) == 5
    for x, y in zip(losses, zero2_reference):
        assert abs(x - y) <= 1e-4 * abs(y), (strategy, losses, zero2_reference)
    if strategy != "zero2":  # another strategy's checkpoint is refused with a clear message
        c = run_train(small_args(small_store, tmp_path, max_steps=8, grad_accum=2, strategy="zero2"), nproc=2)
        assert c.returncode != 0 and f"strategy={strategy!r}" in c.stderr, c.stderr[-2000:]
