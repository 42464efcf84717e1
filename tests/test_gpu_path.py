"""The GPU path's pieces that a CPU can check: the process group bound to the rank's GPU (device_id), the batches'
pinned host buffers reused only once their copy is done, and the copy's protocol on the streams (a side stream, the
compute stream waiting for it, record_stream). bench/gpu.py's data_copy and base_step run them on a GPU."""
import inspect
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.distributed as dist

import configurator
import data
import train
from infra import distributed
from model import build_model


def _fake_init(monkeypatch, cuda):
    """distributed.init() with CUDA present or not and torch.distributed's start recorded, not done."""
    seen = {}
    for k, v in (("RANK", "3"), ("LOCAL_RANK", "3"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", "1"), ("DS_ACCELERATOR", "cpu")):
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.setdefault("set_device", d))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: seen.setdefault("init", kw))
    return seen


def test_nccl_is_bound_to_the_ranks_gpu(monkeypatch):
    real = inspect.signature(dist.init_process_group)
    seen = _fake_init(monkeypatch, cuda=True)
    rank, world, device = distributed.init()
    assert (rank, world, device) == (3, 4, torch.device("cuda", 3)) and seen["set_device"] == 3
    assert seen["init"] == {"backend": "nccl", "device_id": torch.device("cuda", 3)}
    real.bind(**seen["init"])  # torch's own init_process_group takes these arguments


def test_gloo_on_cpu_has_no_device_id(monkeypatch):
    seen = _fake_init(monkeypatch, cuda=False)
    assert distributed.init()[2] == torch.device("cpu") and seen["init"] == {"backend": "gloo"}


class FakeEvent:
    def __init__(self, log=None, stream=None):
        self.log, self.stream, self.synced = log, stream, False

    def synchronize(self):
        self.synced = True


def test_a_pinned_buffer_is_handed_out_again_only_after_its_copy():
    pool = data.PinnedBuffers(pin=False)
    a = pool.take((2, 3), torch.bfloat16)
    b = pool.take((2, 3), torch.bfloat16)
    assert a.data_ptr() != b.data_ptr() and pool.allocated == 2  # both out: two buffers
    done = FakeEvent()
    pool.give_back(a, done)
    c = pool.take((2, 3), torch.bfloat16)
    assert c is a and done.synced and pool.allocated == 2  # a again, once its copy's event was waited on
    assert pool.take((2, 4), torch.bfloat16) is not a and pool.take((2, 3), torch.float32) is not a  # per shape, dtype


def test_prepare_batch_fills_a_reused_buffer_on_the_gpu_path():
    cfg = configurator.defaults()
    configurator.apply(cfg, ["config/quickstart.py"])
    job = SimpleNamespace(cfg=cfg, model=build_model(cfg, device="meta"), cp_rank=0, cp=1, on_gpu=True,
                          dtype=torch.bfloat16, pinned=data.PinnedBuffers(pin=False))
    shape = (cfg["micro_batch"], 1, *cfg["crop"])
    x1, ids_keep1 = train.prepare_batch(job, torch.full(shape, 1.0), list(range(cfg["micro_batch"])))
    keep = ids_keep1.clone()
    assert x1.dtype == torch.bfloat16 and bool((x1 == 1).all())
    job.pinned.give_back(x1)
    job.pinned.give_back(ids_keep1)
    x2, ids_keep2 = train.prepare_batch(job, torch.full(shape, 2.0), list(range(cfg["micro_batch"])))
    assert x2 is x1 and ids_keep2 is ids_keep1 and bool((x2 == 2).all()) and torch.equal(ids_keep2, keep)
    x3, _ = train.prepare_batch(job, torch.full(shape, 3.0), [0] * cfg["micro_batch"])
    assert x3 is not x2 and bool((x2 == 2).all())  # x2 not given back: a new buffer, x2 untouched


def test_the_copy_runs_on_the_side_stream_and_the_compute_stream_waits_for_it(monkeypatch):
    log, current = [], ["compute"]

    class Host:
        shape, dtype = (4,), torch.bfloat16

        def __init__(self, name):
            self.name = name

        def to(self, device, non_blocking=False):
            log.append(("copy", self.name, current[0], non_blocking))
            return Device(self.name)

    class Device:
        def __init__(self, name):
            self.name = name

        def record_stream(self, s):
            log.append(("record_stream", self.name, s))

    class Stream:
        def wait_event(self, e):
            log.append(("wait", current[0], e.stream))

    @contextmanager
    def on(stream):
        current.insert(0, stream)
        yield
        current.pop(0)

    class Event(FakeEvent):
        def record(self):
            self.stream = current[0]

    compute = Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: compute)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    job = SimpleNamespace(on_gpu=True, device="cuda", copy_stream="side", pinned=data.PinnedBuffers(pin=False))
    x, ids = Host("x"), Host("ids")
    xd, idd = train.to_device(job, x, ids)
    assert (xd.name, idd.name) == ("x", "ids")
    assert log[:2] == [("copy", "x", "side", True), ("copy", "ids", "side", True)]  # both on the side stream
    assert log[2] == ("wait", "compute", "side")  # the compute stream waits for the side stream's event
    assert set(log[3:]) == {("record_stream", "x", compute), ("record_stream", "ids", compute)}
    back = [e for q in job.pinned.free.values() for e in q]
    assert {id(b) for b, _ in back} == {id(x), id(ids)} and all(e.stream == "side" for _, e in back)
    job.on_gpu = False
    assert train.to_device(job, x, ids) == (x, ids) and len(log) == 5  # CPU: the batch as it is
