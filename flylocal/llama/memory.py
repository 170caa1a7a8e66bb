"""What a context will take, checked before llama.cpp allocates it (docs/operations.md, "Memory").

llama.cpp sizes a context's buffers for the whole `--ctx` when it creates it, and a context too
big for the machine is not refused: it is killed by the kernel later, with no message. So the
runtime adds up, before creating one:

- the KV cache: layers x context x KV heads x (key + value width) x 2 bytes (f16 cells, less for
  a quantized --cache-type-k/v; a
  sliding-window model keeps a full-size cache here, flylocal.llama.runtime);
- the compute buffers: a batch's logits (batch x vocabulary x 4 bytes), and without flash
  attention the attention scores of a batch against the whole context (context x batch x
  (heads + 1) x 4 bytes; flash attention never holds them whole: about a batch x 1 byte per
  cell). Measured on SmolLM2-135M: 98 MiB at 4K cells and 142 MiB at 128K with flash attention,
  2,566 MiB at 128K without; the formula gives 98, 160 and 2,656;
- the model file (mapped, and read whole as it runs).

and compares the sum with 90% of the memory available now: /proc/meminfo's MemAvailable, or the
cgroup's limit less what it uses where that is lower (a container). The part of it on a GPU
(the offloaded layers' weights and cache) is compared with the GPU's free memory instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

GiB = float(1 << 30)
# Bytes per value of each KV cache type (--cache-type-k/v): a quantized type packs 32 values
# with their scale (and offset) in a block.
CELL_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32,
              "q4_1": 20 / 32, "q4_0": 18 / 32, "iq4_nl": 18 / 32}
HEADROOM = 0.9          # a context may take 90% of what is available: the rest is the machine's


@dataclass(frozen=True)
class Shape:
    """What of a model decides its context's size."""
    n_layer: int
    n_head: int
    n_head_kv: int
    key_width: int        # per head
    value_width: int
    n_vocab: int
    model_bytes: int
    key_bytes: float = 2.0     # per cached value (f16 cells unless --cache-type-k/v say otherwise)
    value_bytes: float = 2.0


@dataclass(frozen=True)
class Need:
    kv: int
    compute: int
    model: int

    @property
    def total(self) -> int:
        return self.kv + self.compute + self.model


def need(shape: Shape, n_ctx: int, n_batch: int, flash: bool) -> Need:
    kv = int(shape.n_layer * n_ctx * shape.n_head_kv * (shape.key_width * shape.key_bytes
                                                         + shape.value_width * shape.value_bytes))
    scores = n_ctx * n_batch * (1 if flash else (shape.n_head + 1) * 4)
    return Need(kv=kv, compute=n_batch * shape.n_vocab * 4 + scores, model=shape.model_bytes)


def held(shape: Shape, n_ctx: int, n_batch: int, flash: bool, gpu_share: float = 0.0, slots: int = 1) -> tuple[int, int]:
    """(bytes a model and its context of `n_ctx` cells for each of `slots` sequences hold, the
    part of them on a GPU where `gpu_share` of its layers are offloaded), counted as `check`
    counts them."""
    needed = need(shape, n_ctx * slots, n_batch, flash)
    return needed.total, int((needed.kv + needed.model) * gpu_share)


def largest_ctx(shape: Shape, n_batch: int, flash: bool, available: int, step: int = 256) -> int:
    """The largest context (a multiple of `step`) whose need fits in `available` bytes; 0 when
    none does."""
    fixed = need(shape, 0, n_batch, flash).total
    per_cell = need(shape, 1, n_batch, flash).total - fixed
    if available <= fixed or per_cell <= 0:
        return 0
    return (available - fixed) // per_cell // step * step


def available_bytes() -> int | None:
    """Memory this process can still take: MemAvailable, or the cgroup's room where smaller;
    None where neither can be read."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
                break
    except (OSError, ValueError, IndexError):
        pass
    room = _cgroup_room()
    if room is not None:
        found.append(room)
    return min(found) if found else None


def _cgroup_room() -> int | None:
    """cgroup v2: memory.max less memory.current, for this process's group; None without a limit."""
    try:
        group = next((line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                      if line.startswith("0::")), None)
        if group is None:
            return None
        base = Path("/sys/fs/cgroup") / group.lstrip("/")
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(int(limit) - int((base / "memory.current").read_text().strip()), 0)
    except (OSError, ValueError):
        return None


def check(shape: Shape, n_ctx: int, n_batch: int, flash: bool, name: str, available: int | None = None,
          gpu_share: float = 0.0, gpu_free: int | None = None, slots: int = 1) -> str | None:
    """The one line saying why a context of `n_ctx` cells (for each of `slots` sequences) does
    not fit, or None when it does (or when nothing can be read). `gpu_share`: the share of
    layers offloaded to GPUs with `gpu_free` bytes free between them."""
    asked = f"--ctx {n_ctx}" + (f" for each of {slots} slots (--parallel)" if slots > 1 else "")
    needed = need(shape, n_ctx * slots, n_batch, flash)
    on_gpu = held(shape, n_ctx, n_batch, flash, gpu_share, slots)[1] if gpu_free is not None else 0
    here = needed.total - on_gpu
    available = available_bytes() if available is None else available
    if available is not None and here > HEADROOM * available:
        fits = largest_ctx(shape, n_batch, flash, int(HEADROOM * available) + on_gpu) // slots // 256 * 256
        return (f"{asked} needs about {here / GiB:.1f} GiB of memory for {name} (KV cache "
                f"{needed.kv * (1 - gpu_share) / GiB:.1f} GiB, compute buffers {needed.compute / GiB:.1f} GiB, "
                f"model {needed.model * (1 - gpu_share) / GiB:.1f} GiB) and {available / GiB:.1f} GiB is available: "
                + (f"the largest --ctx that fits is {fits}" if fits else "not even a small context fits"))
    if gpu_free is not None and on_gpu > gpu_free:
        fits = (largest_ctx(shape, n_batch, True, int(gpu_free / gpu_share)) if gpu_share else 0) // slots // 256 * 256
        return (f"{asked} needs about {on_gpu / GiB:.1f} GiB of GPU memory for {name}'s offloaded layers "
                f"and {gpu_free / GiB:.1f} GiB is free: the largest --ctx that fits is {fits}, or offload fewer "
                "layers (--gpu-layers)")
    return None
