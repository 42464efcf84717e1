"""compile=True: torch.compile of each block, under every strategy, across a stop and resume, and with context
parallelism (the ring is one opaque op to the compiler). The compiled run follows the eager one: the same
losses and validation losses, to 1e-5 (inductor fuses the elementwise work: roundings may differ, the function
does not). One inductor cache for the whole session: the later runs reuse the first runs' kernels."""
import pytest

from conftest import STRATEGY_ARGS, job_env, read_log, read_val, run_train, small_args

pytestmark = pytest.mark.slow  # (tests/README.md: the editing loop's subset leaves it out)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return job_env(TORCHINDUCTOR_CACHE_DIR=str(tmp_path_factory.mktemp("inductor")))


def close(a, b, tol=1e-5):
    return all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b)) and len(a) == len(b)


@pytest.mark.parametrize("strategy", ["zero2", "zero3", "fsdp2"])
def test_compiled_blocks_follow_the_eager_run_across_a_resume(strategy, small_store, strategy_runs, cache, tmp_path):
    """2 ranks, compiled, steps 0..4 of the 8-step schedule of conftest.strategy_runs (eager; stopped after step 3
    and resumed: the reference). zero2 is also stopped after step 3 (checkpoint, exit) and resumed to step 5 under
    compile; zero3 and fsdp2 run to step 5 at once (their compiled graphs differ: ZeRO-3's and FSDP2's hooks)."""
    d = tmp_path / strategy
    for stop in ((3, 5) if strategy == "zero2" else (5,)):
        r = run_train(small_args(small_store, d, stop_step=stop, strategy=strategy, compile=True, **STRATEGY_ARGS),
                      nproc=2, env=cache)
        assert r.returncode == 0, r.stderr[-3000:]
    ref = {x["step"]: x["loss"] for x in read_log(strategy_runs[strategy][0])}
    got = {x["step"]: x["loss"] for x in read_log(d)}
    assert sorted(got) == [0, 1, 2, 3, 4]
    assert close([got[s] for s in range(5)], [ref[s] for s in range(5)]), (got, ref)
    ref_val = dict(read_val(strategy_runs[strategy][0]))
    got_val = dict(read_val(d))
    assert close([got_val[s] for s in (0, 3)], [ref_val[s] for s in (0, 3)]), (got_val, ref_val)


def test_compiled_cp2_matches_eager_cp1(small_store, cache, tmp_path):
    """dp 1 x cp 2, compiled (the ring between the compiled halves of each block) against one eager rank."""
    one = run_train(small_args(small_store, tmp_path / "cp1", max_steps=4, mask_strata=2), nproc=1)
    two = run_train(small_args(small_store, tmp_path / "cp2", max_steps=4, cp=2, compile=True), nproc=2, env=cache)
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    a, b = [x["loss"] for x in read_log(tmp_path / "cp1")], [x["loss"] for x in read_log(tmp_path / "cp2")]
    assert len(a) == 4 and close(b, a), (a, b)
