"""The pack kernels' machine code for NVIDIA GPUs, read on any machine.

Triton's wheel bundles ptxas, cuobjdump and nvdisasm, so a machine without a GPU can compile a kernel for
sm_80, sm_90 or sm_100 and read what it became. For one launch (the kernel, grid and arguments
that permute.launch_spec gives) this module

1. derives the specialization Triton's launcher gives those arguments (16-byte aligned pointers
   and integers divisible by 16 become `tt.divisibility` attributes) with Triton's own binder,
   and compiles the kernel for the target;
2. reads the cubin's resources (registers per thread, local memory: spills and stack) and its
   SASS: every global load and store with its width, and which loads feed a store (the data
   path, traced register by register);
3. turns them into what they allow: resident warps per SM (registers per thread rounded up to
   the allocation unit), the bytes a thread has in flight (its data loads issued before its first
   store) and the bytes in flight per SM.

Little's law says what a device needs: to sustain a bandwidth B over a memory latency L, its
SMs together keep B x L bytes in flight, B x L / SMs each. `register_budget` is the most
registers per thread that still keep that (times a margin) in flight for a kernel's bytes per
thread; tests/test_machine_code.py holds every kernel configuration the presets use to it, and
experiments.bench.kernels prints the bound these facts put on each device's bandwidth.

Compiling needs Triton un-interpreted. In a process where it is interpreted (every CPU run:
kernels._triton switches the interpreter on without CUDA), `inspect_launches` runs this module in
a child process with TRITON_INTERPRET=0 and reads its answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import zlib
from dataclasses import asdict, dataclass, field
from itertools import accumulate

ARCHS = (80, 90, 100)
DTYPES = ("bf16", "fp16", "fp32")
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class SMLimits:
    """What one SM of a compute capability holds (the CUDA C++ Programming Guide's table of
    technical specifications per compute capability, the same for 8.0, 9.0 and 10.0)."""

    registers: int = 65536  # 32-bit registers per SM
    max_warps: int = 64  # resident warps per SM
    max_blocks: int = 32  # resident blocks per SM
    register_unit: int = 256  # registers are allocated to a warp in units of this many


SM_LIMITS = {80: SMLimits(), 90: SMLimits(), 100: SMLimits()}


def resident_warps(registers: int, num_warps: int, limits: SMLimits = SMLimits()) -> int:
    """Warps of a kernel that fit on one SM at once, limited by registers, warps and blocks (the
    pack kernels use no shared memory).

    >>> resident_warps(32, 4), resident_warps(56, 4), resident_warps(160, 4)
    (64, 36, 12)
    """
    per_warp = -(-registers * 32 // limits.register_unit) * limits.register_unit
    blocks = min(limits.registers // (per_warp * num_warps), limits.max_warps // num_warps, limits.max_blocks)
    return blocks * num_warps


def bytes_in_flight_needed(bandwidth: float, latency_s: float, sms: int) -> float:
    """Little's law: bytes one SM must keep in flight for the device to sustain `bandwidth`.

    >>> round(bytes_in_flight_needed(3.35e12, 0.7e-6, 132))  # H100 SXM
    17765
    """
    return bandwidth * latency_s / sms


def register_budget(need_per_sm: float, bytes_per_thread: int, num_warps: int, limits: SMLimits = SMLimits()) -> int:
    """The most registers per thread with which a kernel that keeps `bytes_per_thread` in flight
    still keeps `need_per_sm` in flight on an SM (0: no register count is enough).

    >>> register_budget(1.5 * 37838, 64, 4)  # B200 with a 1.5x margin, four 16-byte vectors a thread
    72
    """
    best = 0
    for regs in range(8, 256, 8):
        if resident_warps(regs, num_warps, limits) * 32 * bytes_per_thread >= need_per_sm:
            best = regs
    return best


# ----- reading SASS ----------------------------------------------------------------------------
_INSTR = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?(?P<op>[A-Z][A-Z0-9_.]*)\s*(?P<args>[^;]*);")
_WIDTHS = {"128": 128, "64": 64, "U16": 16, "S16": 16, "U8": 8, "S8": 8}


def _width(opcode: str) -> int:
    bits = [_WIDTHS[p] for p in opcode.split(".")[1:] if p in _WIDTHS]
    return bits[0] if bits else 32


def _reg(token: str) -> int | None:
    m = re.fullmatch(r"R(\d+)", token.strip())
    return int(m.group(1)) if m else None


@dataclass
class Accesses:
    """The global loads and stores of a kernel's SASS, by width in bits."""

    data_loads: dict = field(default_factory=dict)  # loads whose registers a store writes out
    other_loads: dict = field(default_factory=dict)  # index loads (rows, peers, the head map)
    stores: dict = field(default_factory=dict)
    bytes_before_first_store: int = 0  # data-load bytes a thread has issued when it first stores
    untraced_stores: int = 0  # stores whose data register no load defines (through moves)


def read_sass(sass: str) -> Accesses:
    """Classify the global accesses of one kernel's SASS (cuobjdump -sass): a store's data
    register is traced back through moves to the load that wrote it; those loads are the data
    path, the rest index loads.

    >>> a = read_sass('''
    ...   /*0010*/   LDG.E.64 R2, desc[UR4][R6.64] ;
    ...   /*0020*/   @P0 LDG.E.128 R8, desc[UR4][R2.64] ;
    ...   /*0030*/   @P0 STG.E.128 desc[UR4][R4.64], R8 ;''')
    >>> a.data_loads, a.other_loads, a.stores, a.bytes_before_first_store
    ({128: 1}, {64: 1}, {128: 1}, 16)
    """
    instrs = [(m.group("op"), [a.strip() for a in m.group("args").split(",")]) for m in _INSTR.finditer(sass)]
    writer: dict[int, int] = {}  # register -> index of the last instruction that wrote it
    loads_at: list[int] = []
    data: set[int] = set()
    out = Accesses()
    first_store = None
    for i, (op, args) in enumerate(instrs):
        if op.startswith("STG"):
            first_store = i if first_store is None else first_store
            w = _width(op)
            out.stores[w] = out.stores.get(w, 0) + 1
            j = writer.get(_reg(args[-1]) if args else None)
            while j is not None and instrs[j][0].startswith("MOV"):
                j = writer.get(_reg(instrs[j][1][1]))
            if j is not None and instrs[j][0].startswith("LDG"):
                data.add(j)
            else:
                out.untraced_stores += 1
            continue
        dest = _reg(args[0]) if args else None
        if dest is not None:
            for r in range(dest, dest + max(1, _width(op) // 32) if op.startswith("LDG") else dest + 1):
                writer[r] = i
        if op.startswith("LDG"):
            loads_at.append(i)
    for i in loads_at:
        w = _width(instrs[i][0])
        kind = out.data_loads if i in data else out.other_loads
        kind[w] = kind.get(w, 0) + 1
        if i in data and (first_store is None or i < first_store):
            out.bytes_before_first_store += w // 8
    return out


def _tool(name: str) -> str:
    import triton  # noqa: PLC0415  (the bundled CUDA tools live in Triton's wheel)

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        raise RuntimeError(f"Triton {triton.__version__} bundles no {name} at {path}: machine code cannot be read here")
    return path


def _text_section(cubin: bytes) -> bytes:
    """The code of a cubin's one kernel: its ELF section named .text.<kernel>."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    entsize, count, names_at = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * entsize) for i in range(count)]
    names = sections[names_at][4]  # the offset of the section-name table
    texts = [
        cubin[off : off + size]
        for name, _, _, _, off, size in sections
        if cubin[names + name : cubin.index(b"\0", names + name)].startswith(b".text.")
    ]
    if len(texts) != 1:
        raise RuntimeError(f"a pack kernel's cubin holds {len(texts)} code sections; one was expected")
    return texts[0]


def read_cubins(cubins: list[tuple[bytes, str]]) -> list[tuple[int, int, str]]:
    """(registers per thread, local bytes per thread (spills and stack), SASS) of each cubin,
    given with its target (`sm_90a`, as in its PTX).

    The resources come from `cuobjdump -res-usage`, a few milliseconds a cubin. The SASS comes from
    nvdisasm, which spends about a third of a second setting up whatever it reads: so the kernels
    of one target are read in one call, their code sections laid end to end as one raw instruction
    image, and cut apart again at the offsets where each began (an instruction is 16 bytes and
    prints its offset; offsets and branch targets are counted again from the kernel's start).
    tests/test_machine_code.py holds the result to `cuobjdump -sass` of each cubin alone."""
    out: list = [None] * len(cubins)
    by_target: dict[str, list[int]] = {}
    for i, (_, target) in enumerate(cubins):
        by_target.setdefault(target, []).append(i)
    with tempfile.TemporaryDirectory() as tmp:
        for target, which in by_target.items():
            texts = [_text_section(cubins[i][0]) for i in which]
            starts = [0, *accumulate(map(len, texts[:-1]))]  # where each kernel begins in the image
            image = os.path.join(tmp, f"{target}.bin")
            with open(image, "wb") as f:
                f.write(b"".join(texts))
            arch = "SM" + target.removeprefix("sm_")
            sass = subprocess.run([_tool("nvdisasm"), "-b", arch, image], capture_output=True, text=True, check=True).stdout
            lines: list[list[str]] = [[] for _ in which]
            k = 0
            for line in sass.splitlines():
                m = re.match(r"\s*/\*([0-9a-f]+)\*/", line)
                if not m:
                    continue
                at = int(m.group(1), 16)
                while k + 1 < len(starts) and at >= starts[k + 1]:
                    k += 1
                lines[k].append(_rebased(line, m.group(1), starts[k]))
            for i, kernel_lines in zip(which, lines):
                path = os.path.join(tmp, f"{i}.cubin")
                with open(path, "wb") as f:
                    f.write(cubins[i][0])
                out[i] = (*_resources(path), "\n".join(kernel_lines))
    return out


_ADDRESSED = re.compile(r"(?P<op>(?:BRA|BSSY|CALL|JMP|BRX|JMX|SSY|PBK|PCNT)\b[^;]*?)0x(?P<to>[0-9a-f]+)(?P<rest>\s*;)")


def _rebased(line: str, offset: str, start: int) -> str:
    """An instruction line of a raw image as its kernel alone prints it: its offset, and the code
    address a branch names, counted from where its kernel begins in the image."""
    line = line.replace(offset, f"{int(offset, 16) - start:04x}", 1)
    return _ADDRESSED.sub(lambda m: f"{m['op']}0x{int(m['to'], 16) - start:x}{m['rest']}", line)


def read_cubin(cubin: bytes) -> tuple[int, int, str]:
    """(registers per thread, local bytes per thread, SASS) of one cubin, all from cuobjdump: the
    yardstick read_cubins is held to."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True).stdout
        return (*_resources(f.name), sass)


def _resources(path: str) -> tuple[int, int]:
    """(registers per thread, local bytes per thread: spills and stack) of the cubin at `path`."""
    res = subprocess.run([_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    return regs, int(re.search(r"LOCAL:(\d+)", res).group(1)) + int(re.search(r"STACK:(\d+)", res).group(1))


# ----- compiling a launch --------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchSpec:
    """One pack-kernel launch to compile: `op` ("gather": pack, "scatter": unpack) moving `rows`
    rows of `heads` heads per peer, between a [*, token_heads, head_dim] tensor and the packed
    [rows, heads, head_dim] one, for compute capability `arch`."""

    op: str
    dtype: str
    head_dim: int
    heads: int
    token_heads: int
    arch: int
    rows: int = 999  # odd: the general case (an M divisible by 16 is specialized on)


@dataclass
class LaunchReport:
    spec: LaunchSpec
    tile: tuple[int, int, int]
    wide: bool
    num_warps: int
    registers: int
    local_bytes: int
    accesses: Accesses
    vector_elements: int  # elements per data access the alignment allows (1: scalar)

    @property
    def resident_warps(self) -> int:
        return resident_warps(self.registers, self.num_warps, SM_LIMITS[self.spec.arch])

    @property
    def bytes_in_flight_per_sm(self) -> int:
        return self.resident_warps * 32 * self.accesses.bytes_before_first_store

    @property
    def aligned(self) -> bool:
        return self.vector_elements > 1

    def to_dict(self) -> dict:
        return {**asdict(self), "resident_warps": self.resident_warps, "bytes_in_flight_per_sm": self.bytes_in_flight_per_sm}

    @staticmethod
    def from_dict(d: dict) -> LaunchReport:
        d = {k: v for k, v in d.items() if k not in ("resident_warps", "bytes_in_flight_per_sm")}
        acc = Accesses(**{k: ({int(w): n for w, n in v.items()} if isinstance(v, dict) else v) for k, v in d.pop("accesses").items()})
        return LaunchReport(spec=LaunchSpec(**d.pop("spec")), tile=tuple(d.pop("tile")), accesses=acc, **d)


def exchange_launches(head_counts, group_size: int, head_dim: int, dtype: str, arch: int) -> list[LaunchSpec]:
    """The pack-kernel launches of one attention layer's exchanges in a group of `group_size`
    ranks, forward and backward: the entry moving Q, K, V (`head_counts`, key/value heads
    replicated where the group is wider than them) and the exit moving the attention output
    (the first part's heads), each a pack (gather) and an unpack (scatter), and their inverses.

    >>> [(s.op, s.heads, s.token_heads) for s in exchange_launches([32, 8, 8], 16, 128, "bf16", 90)][:4]
    [('gather', 4, 48), ('scatter', 4, 4), ('gather', 4, 4), ('scatter', 4, 64)]
    """
    from .exchange import head_split_map, replica_counts  # noqa: PLC0415

    def both_ways(counts):
        per_peer = head_split_map(counts, group_size).shape[1]
        reps = replica_counts(counts, group_size)
        slots = sum(h * r for h, r in reps) if reps else sum(counts)
        # to heads: pack from the token layout, unpack into the head layout; back: the inverse,
        # unpacking into one slot per replica of a replicated head
        return [
            ("gather", per_peer, sum(counts)),
            ("scatter", per_peer, per_peer),
            ("gather", per_peer, per_peer),
            ("scatter", per_peer, slots),
        ]

    shapes = both_ways(list(head_counts)) + both_ways(list(head_counts)[:1])
    return list(dict.fromkeys(LaunchSpec(op, dtype, head_dim, h, t, arch) for op, h, t in shapes))


def _tensors(spec: LaunchSpec):
    import torch  # noqa: PLC0415

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[spec.dtype]
    token_side = torch.empty(spec.rows, spec.token_heads, spec.head_dim, dtype=dt)
    packed = torch.empty(spec.rows, spec.heads, spec.head_dim, dtype=dt)
    rows = torch.arange(spec.rows, dtype=torch.int64)
    peers = torch.zeros(spec.rows, dtype=torch.int32)
    head_map = torch.zeros(2, spec.heads, dtype=torch.int32)
    src, out = (token_side, packed) if spec.op == "gather" else (packed, token_side)
    return src, out, rows, peers, head_map


def _compile(spec: LaunchSpec) -> tuple:
    """Compile one launch for its target, with the launcher's specialization: (the launch's tile
    meta-parameters, num_warps, the cubin, the PTX target)."""
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource, make_backend  # noqa: PLC0415
    from triton.runtime.jit import create_function_from_signature  # noqa: PLC0415

    from .permute import launch_spec  # noqa: PLC0415

    if spec.arch not in SM_LIMITS:
        raise ValueError(f"arch={spec.arch}: compute capabilities known here are {sorted(SM_LIMITS)}")
    src, out, rows, peers, head_map = _tensors(spec)
    kernel, _, args, meta = launch_spec(spec.op, src, out, rows, peers, head_map)
    target = GPUTarget("cuda", spec.arch, 32)
    backend = make_backend(target)
    # Triton's launcher binds the arguments like this on every call: its specialization
    # (pointer alignment, integers divisible by 16) is what decides the vector width
    bind = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = bind(*args, **meta)
    options, signature, constexprs, attrs = kernel._pack_args(backend, options, bound, specialization, options)
    key = (kernel.__name__, spec.arch, repr(signature), repr(sorted(constexprs.items())), repr(sorted(attrs.items())))
    if key not in _COMPILED:  # launches with the same specialization compile once
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)
        ptx_target = re.search(r"^\s*\.target\s+(sm_\w+)", compiled.asm["ptx"], re.M).group(1)
        _COMPILED[key] = (compiled.metadata.num_warps, compiled.asm["cubin"], ptx_target)
    return meta, *_COMPILED[key]


def compile_launches(specs: list[LaunchSpec]) -> list[LaunchReport]:
    """Compile every launch for its target and read it back. Specializations that do not change
    the code (about half of them: bf16 and fp16 copies, token-side head counts) give the same
    bytes, and each binary is read once."""
    from .permute import vector_elements  # noqa: PLC0415

    compiled = [_compile(s) for s in specs]
    digests = [hashlib.sha256(cubin).hexdigest() for _, _, cubin, _ in compiled]
    fresh = {}
    for digest, (_, _, cubin, target) in zip(digests, compiled):
        if digest not in _CUBINS:
            fresh.setdefault(digest, (cubin, target))
    _CUBINS.update(zip(fresh, read_cubins(list(fresh.values()))))
    reports = []
    for spec, digest, (meta, num_warps, _, _) in zip(specs, digests, compiled):
        regs, local, sass = _CUBINS[digest]
        reports.append(
            LaunchReport(
                spec=spec,
                tile=(meta["BLOCK_M"], meta["BLOCK_H"], meta["BLOCK_D"]),
                wide=bool(meta["WIDE"]),
                num_warps=num_warps,
                registers=regs,
                local_bytes=local,
                accesses=read_sass(sass),
                vector_elements=vector_elements(spec.head_dim, ELEMENT_BYTES[spec.dtype]),
            )
        )
    return reports


_COMPILED: dict = {}  # (kernel, arch, specialization) -> (num_warps, cubin, PTX target)
_CUBINS: dict = {}  # sha256 of a cubin -> (registers, local bytes, SASS)


def inspect_launches(specs: list[LaunchSpec], processes: int | None = None) -> list[LaunchReport]:
    """compile_launches of the specs, in order. In a process whose Triton is interpreted, in child
    processes with the interpreter off (`processes` of them, default one per CPU up to 4, each
    compiling a share; the answers travel as JSON)."""
    from ._triton import INTERPRETED  # noqa: PLC0415

    if not INTERPRETED:
        return compile_launches(specs)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said out loud to keep it quiet
    n = max(1, min(processes or min(os.cpu_count() or 1, 4), len(specs)))
    # launches likely to share a binary go to the same child, which disassembles each binary once:
    # the same tile, head size and element width (a copy kernel's code does not tell bf16 from
    # fp16, nor depends on the token side's head count); the answers keep the order of the specs
    from .permute import tile_shape  # noqa: PLC0415

    def share_of(s: LaunchSpec) -> int:
        tile = tile_shape(s.heads, s.head_dim, ELEMENT_BYTES[s.dtype])
        return zlib.crc32(repr((s.op, ELEMENT_BYTES[s.dtype], s.head_dim, tile, s.heads % 16, s.arch)).encode()) % n

    where = [share_of(s) for s in specs]
    shares = [[s for s, w in zip(specs, where) if w == k] for k in range(n)]
    errors = [tempfile.TemporaryFile(mode="w+") for _ in shares]  # a file each: a full stderr pipe cannot stall a child
    children = [
        subprocess.Popen(
            [sys.executable, "-c", "from kernels.machine_code import serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
            cwd=root,
        )
        for err in errors
    ]
    for c, share in zip(children, shares):  # every child gets its share before any is waited for
        c.stdin.write(json.dumps([asdict(s) for s in share]))
        c.stdin.close()
    answers = [(c.stdout.read(), c.wait()) for c in children]
    for (_, code), err in zip(answers, errors):
        err.seek(0)
        if code:
            raise RuntimeError(f"compiling the kernels for GPU targets failed:\n{err.read()[-4000:]}")
        err.close()
    answered = [iter(LaunchReport.from_dict(d) for d in json.loads(out)) for out, _ in answers]
    return [next(answered[w]) for w in where]


def serve() -> None:
    """The child's side of inspect_launches: LaunchSpecs as JSON on stdin, reports on stdout."""
    specs = [LaunchSpec(**d) for d in json.load(sys.stdin)]
    json.dump([r.to_dict() for r in compile_launches(specs)], sys.stdout)
