"""Moving policy weights from the learner to the rollout engines, with a version number.

Two transports, one payload format:

* ``FlatWeights`` — every tensor of the policy packed into one contiguous ``uint8`` numpy buffer
  plus a list of ``TensorSpec`` (name, dtype, shape, byte offset). One buffer means one object in
  Ray's object store and one zero-copy read per worker; the spec list is plain data (no pickle
  of tensors is needed anywhere). bf16 travels as raw bytes, so no dtype is lost.
* **Object store** (CPU default): the learner's rank 0 calls ``ray.put(flat)`` once; every rollout
  worker receives the ``ObjectRef`` as an argument and Ray hands it the same shared-memory buffer
  (see ``push_weights_via_object_store``).
* **Collective** (``WeightSyncGroup``): a process group *separate from* torch.distributed's
  default group, built from a ``TCPStore``; rank 0 is the learner's rank 0 and ranks 1..N are the
  engines (for vLLM every tensor-parallel worker is one rank). ``backend="gloo"`` broadcasts CPU
  tensors; ``"nccl"`` (torch's ``ProcessGroupNCCL``) and ``"pynccl"`` (vLLM's
  ``StatelessProcessGroup`` + ``PyNcclCommunicator``, what vLLM recommends for talking to its
  workers from outside) broadcast GPU tensors. Every rank of one group must use the same backend:
  use ``"pynccl"`` whenever a vLLM engine is in the group. The GPU backends run the very code
  that the gloo tests run on CPU, except for the two communicator calls. Rank 0 first broadcasts the spec list as JSON, then
  the packed bytes in buckets of at most ``bucket_bytes``, so receivers can load bucket by bucket
  without holding a second full copy of a large model.

Versions: the learner bumps its version after every optimizer update; an engine stores the
version of the weights it last loaded in ``engine.weight_version`` and stamps it on every
``GenerationResult``. Nothing here imports an engine or a learner, so both sides can use it.
"""

from __future__ import annotations

import datetime
import json
import socket
import warnings
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

BACKENDS = ("gloo", "nccl", "pynccl")

_ALIGN = 64  # byte alignment of every tensor in the flat buffer (enough for any dtype view)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported tensor dtype {name!r} for weight sync; expected one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class TensorSpec:
    """Where one named tensor lives inside a flat byte buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_json(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.offset, self.nbytes]

    @classmethod
    def from_json(cls, item: Sequence) -> "TensorSpec":
        name, dtype, shape, offset, nbytes = item
        return cls(str(name), str(dtype), tuple(int(s) for s in shape), int(offset), int(nbytes))


def layout(named_shapes: Iterable[tuple[str, torch.dtype, Sequence[int]]]) -> tuple[list[TensorSpec], int]:
    """Assign aligned byte offsets; returns the specs and the total buffer size."""
    specs, offset = [], 0
    for name, dtype, shape in named_shapes:
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        specs.append(TensorSpec(name, dtype_name(dtype), tuple(int(s) for s in shape), offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return specs, offset


def _view(buffer: torch.Tensor, spec: TensorSpec, base: int = 0) -> torch.Tensor:
    start = spec.offset - base
    return buffer[start : start + spec.nbytes].view(dtype_from_name(spec.dtype)).view(spec.shape)


def _as_uint8_tensor(array: np.ndarray) -> torch.Tensor:
    # Buffers fetched from Ray's object store are read-only; we only ever read from them (the
    # engine copies into its own parameters), so torch's non-writable warning is noise here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


@dataclass
class FlatWeights:
    """A versioned snapshot of a model's tensors packed into one byte buffer."""

    version: int
    specs: list[TensorSpec]
    buffer: np.ndarray  # 1-D uint8

    @classmethod
    def from_named_tensors(
        cls, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int
    ) -> "FlatWeights":
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        specs, total = layout((n, t.dtype, t.shape) for n, t in items)
        buffer = torch.empty(total, dtype=torch.uint8)
        for spec, (_, tensor) in zip(specs, items):
            _view(buffer, spec).copy_(tensor.detach())
        return cls(int(version), specs, buffer.numpy())

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)

    def named_tensors(self, device: str | torch.device | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` views into the buffer (moved to ``device`` when given)."""
        buf = _as_uint8_tensor(self.buffer)
        for spec in self.specs:
            t = _view(buf, spec)
            yield spec.name, (t.to(device) if device is not None else t)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.named_tensors())


def named_tensors_of(weights) -> tuple[Iterable[tuple[str, torch.Tensor]], int | None]:
    """Normalise what an engine may be handed: ``FlatWeights``, a mapping, or ``(name, tensor)`` pairs.

    Returns the pairs and the version carried by the payload (``None`` when it carries none).
    """
    if isinstance(weights, FlatWeights):
        return weights.named_tensors(), weights.version
    if isinstance(weights, Mapping):
        return weights.items(), None
    return weights, None


# ---------------------------------------------------------------------------------------------
# what each side answers
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Loaded:
    """A rollout worker's answer to a sync: the weight version it now holds and, when the sync
    carried the verifier's probe (``actors.sync_verify``), its log p(x_t | x_<t) of the probe under
    those weights, scored in the same call so that verifying a sync costs no second round trip."""

    version: int
    probe_logprobs: list[float] | None = None


@dataclass(frozen=True)
class Published:
    """A learner rank's answer to a sync: the ``ObjectRef`` of the weights it put in the object
    store (rank 0 of an object-store sync, else ``None``), the bytes it broadcast (rank 0 of a
    collective sync, else 0) and, when the sync carried the probe, its log-probs of the probe (rank 0,
    and every rank under ZeRO-3, whose forward needs them all; else ``None``)."""

    weights: object = None
    bytes_sent: int = 0
    probe_logprobs: torch.Tensor | None = None


ProbeScores = tuple[torch.Tensor, list[list[float]]]  # the learner's probe log-probs, and each worker's


def probe_scores(learner: Published, workers: Sequence[Loaded]) -> ProbeScores:
    """A ``SyncVerifier``'s scores from the answers of a sync that carried the probe: the learner's
    vector and one per worker, in worker order."""
    if learner.probe_logprobs is None or any(w.probe_logprobs is None for w in workers):
        raise RuntimeError("a sync that carried the verifier's probe came back without its scores")
    return learner.probe_logprobs, [w.probe_logprobs for w in workers]


# ---------------------------------------------------------------------------------------------
# object store
# ---------------------------------------------------------------------------------------------


def push_weights_via_object_store(weights_ref, workers: Sequence, *, probe: Sequence[int] | None = None,
                                  timeout_s: float | None = None) -> list[Loaded]:
    """Hand one ``ray.put`` of ``FlatWeights`` to every rollout worker; returns their ``Loaded``
    answers (with their scores of ``probe`` when one is given).

    ``weights_ref`` is the ``ObjectRef`` of a ``FlatWeights`` (``LearnerGroup.publish_weights``
    makes it). Passing the ref as a top-level argument lets Ray resolve it inside each worker from
    shared memory: the driver never copies the weights.
    """
    import ray

    # the async variant works for every engine: vLLM's AsyncLLM updates asynchronously
    return ray.get([w.update_weights_async.remote(weights_ref, probe=probe) for w in workers], timeout=timeout_s)


# ---------------------------------------------------------------------------------------------
# collective (gloo on CPU, NCCL on GPU)
# ---------------------------------------------------------------------------------------------


def pick_free_port(host: str = "") -> int:
    """A TCP port that was free a moment ago (the usual bind-to-0 trick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def node_address() -> str:
    """This node's IP as Ray sees it, or loopback outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - any failure means "not in a Ray worker"
        pass
    return "127.0.0.1"


class WeightSyncGroup:
    """A stand-alone broadcast group: rank 0 sends weights, ranks 1..world_size-1 receive them.

    It does not touch torch.distributed's default process group, so a learner that already runs
    DeepSpeed data parallelism (its own gloo/NCCL group) and engines that run vLLM tensor
    parallelism (theirs) can both join. Every rank must construct it at about the same time
    (the constructor blocks on the rendezvous), and every ``send``/``receive`` pairs up.
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        *,
        backend: str = "gloo",
        device: str | torch.device | None = None,
        timeout_s: float = 600.0,
        bucket_bytes: int = 256 << 20,
        group_name: str = "raggym-weight-sync",
    ):
        if world_size < 2:
            raise ValueError(f"a weight-sync group needs a sender and at least one receiver, got world_size={world_size}")
        if backend not in BACKENDS:
            raise ValueError(f"weight-sync backend must be one of {BACKENDS}, got {backend!r}")
        self.rank, self.world_size, self.backend = int(rank), int(world_size), backend
        self.bucket_bytes = int(bucket_bytes)
        if device is None:
            device = f"cuda:{torch.cuda.current_device()}" if backend != "gloo" else "cpu"
        self.device = torch.device(device)
        self._pg = self._comm = self._store = None
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "pynccl":  # pragma: no cover - needs GPUs and vllm
            # vLLM's recommended way to talk NCCL to its workers from outside: a stateless TCP
            # rendezvous plus its own NCCL wrapper, independent of any torch.distributed group.
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup

            torch.cuda.set_device(self.device)
            group = StatelessProcessGroup.create(host=host, port=int(port), rank=self.rank, world_size=self.world_size)
            self._comm = PyNcclCommunicator(group, device=self.device)
            self._store = group
            return
        store = torch.distributed.TCPStore(host, int(port), self.world_size, self.rank == 0, timeout=timeout)
        prefixed = torch.distributed.PrefixStore(group_name, store)
        if backend == "gloo":
            self._pg = torch.distributed.ProcessGroupGloo(prefixed, self.rank, self.world_size, timeout)
        else:  # pragma: no cover - needs GPUs
            torch.cuda.set_device(self.device)
            opts = torch.distributed.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._pg = torch.distributed.ProcessGroupNCCL(prefixed, self.rank, self.world_size, opts)
        self._store = store  # keep the rendezvous alive as long as the group

    def _broadcast(self, tensor: torch.Tensor) -> None:
        if self._comm is not None:  # pragma: no cover - pynccl
            stream = torch.cuda.current_stream()
            self._comm.broadcast(tensor, src=0, stream=stream)
            stream.synchronize()
            return
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        self._pg.broadcast([tensor], opts).wait()

    def _buckets(self, specs: list[TensorSpec]) -> list[list[TensorSpec]]:
        buckets: list[list[TensorSpec]] = [[]]
        start = 0
        for spec in specs:
            if buckets[-1] and spec.offset + spec.nbytes - start > self.bucket_bytes:
                buckets.append([])
            if not buckets[-1]:
                start = spec.offset
            buckets[-1].append(spec)
        return [b for b in buckets if b]

    def _bucket_span(self, bucket: list[TensorSpec]) -> tuple[int, int]:
        return bucket[0].offset, bucket[-1].offset + bucket[-1].nbytes

    def send(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int
    ) -> int:
        """Rank 0: broadcast the spec list, then the tensors bucket by bucket. Returns bytes sent."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 of a weight-sync group sends")
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        specs, _ = layout((n, t.dtype, t.shape) for n, t in items)
        header = json.dumps({"version": int(version), "specs": [s.to_json() for s in specs]}).encode()
        size = torch.tensor([len(header)], dtype=torch.int64, device=self.device)
        self._broadcast(size)
        self._broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device))
        by_name = dict(items)
        sent = 0
        for bucket in self._buckets(specs):
            lo, hi = self._bucket_span(bucket)
            buf = torch.empty(hi - lo, dtype=torch.uint8, device=self.device)
            for spec in bucket:
                _view(buf, spec, base=lo).copy_(by_name[spec.name].detach())
            self._broadcast(buf)
            sent += hi - lo
        return sent

    def receive(self) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
        """Ranks ≥ 1: returns the version and an iterator of ``(name, tensor)`` on ``self.device``.

        The iterator receives bucket by bucket as it is consumed, so it must be consumed fully
        (the sender blocks until every bucket is taken); tensors of one bucket are views into
        that bucket's buffer.
        """
        if self.rank == 0:
            raise RuntimeError("rank 0 of a weight-sync group sends; it cannot receive")
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(size)
        raw = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._broadcast(raw)
        header = json.loads(bytes(raw.cpu().numpy()).decode())
        specs = [TensorSpec.from_json(s) for s in header["specs"]]

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for bucket in self._buckets(specs):
                lo, hi = self._bucket_span(bucket)
                buf = torch.empty(hi - lo, dtype=torch.uint8, device=self.device)
                self._broadcast(buf)
                for spec in bucket:
                    yield spec.name, _view(buf, spec, base=lo)

        return int(header["version"]), tensors()

    def close(self) -> None:
        self._pg = self._comm = self._store = None


__all__ = [
    "BACKENDS",
    "FlatWeights",
    "Loaded",
    "ProbeScores",
    "Published",
    "TensorSpec",
    "WeightSyncGroup",
    "dtype_from_name",
    "dtype_name",
    "layout",
    "named_tensors_of",
    "node_address",
    "pick_free_port",
    "probe_scores",
    "push_weights_via_object_store",
]
