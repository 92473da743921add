"""Compile `torch_call.cc` (and the headers it includes) into a shared library, once per (source, versions, compiler), cached on disk.

The system C++ compiler (`$CXX`, else `c++`) builds against torch's headers and
libraries and JAX's FFI headers; no ninja, no `torch.utils.cpp_extension.load`.
The library lands in `$JAXBRIDGE_CACHE_DIR/<key>/` (default
`~/.cache/nvalchemi_jaxbridge/ffi/<key>/`); a file lock makes concurrent
processes (the ranks of the torch front door) build it once, and the file is
written under a temporary name and renamed, so nobody loads a half-written one.
"""

from __future__ import annotations

import dataclasses
import fcntl
import glob
import hashlib
import logging
import os
import pathlib
import shlex
import subprocess
import sysconfig
import sys
import time
from typing import Any

from ..torch_op import KernelError

_log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).with_name("torch_call.cc")
INCLUDED = tuple(pathlib.Path(__file__).with_name(n) for n in (  # included by SOURCE
    "autograd_calls.cc", "buffers.cc", "plan.cc", "graphs.cc"))
LIB_NAME = "jaxbridge_torch_call.so"
EXPECTED_SECONDS = 30  # first-use build: 29 s measured on 2 busy cores (g++ 12, 2026-12-03); said in the log and docs
FALLBACK = (
    'Use the buffer_callback path instead: TorchOpKernel(op, call_path="callback"), or set '
    "JAXBRIDGE_KERNEL_PATH=callback."
)


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """Everything that decides the compiled library: the command and the cache key."""

    compiler: str
    compiler_version: str
    include_dirs: tuple[str, ...]
    lib_dir: str
    cuda: bool
    cxx_std: str
    abi: int
    versions: tuple[str, ...]  # torch, jax, jaxlib

    def key(self) -> str:
        """Cache key: hash of the source and its headers, the compiler command (flags too), compiler and versions."""
        h = hashlib.sha256(SOURCE.read_bytes())
        for header in INCLUDED:
            h.update(b"\0" + header.read_bytes())
        for part in (*self.command(pathlib.Path(LIB_NAME)), self.compiler_version, *self.versions):
            h.update(b"\0" + part.encode())
        return h.hexdigest()[:16]

    def command(self, out: pathlib.Path) -> list[str]:
        """The compiler command line that writes the library to `out`."""
        cmd = [*shlex.split(self.compiler), f"-std={self.cxx_std}", "-O2", "-fPIC", "-shared",
               f"-D_GLIBCXX_USE_CXX11_ABI={self.abi}", "-Wno-deprecated-declarations"]
        if self.cuda:
            cmd.append("-DJB_WITH_CUDA")
        cmd += [f"-I{d}" for d in self.include_dirs]
        cmd += [str(SOURCE), "-o", str(out), f"-L{self.lib_dir}", f"-Wl,-rpath,{self.lib_dir}"]
        cmd += ["-lc10", "-ltorch_cpu", "-ltorch"]
        if self.cuda:
            cmd += ["-lc10_cuda", "-ltorch_cuda"]
        return cmd


def cache_root() -> pathlib.Path:
    """Where built libraries live: `$JAXBRIDGE_CACHE_DIR`, else ~/.cache/nvalchemi_jaxbridge/ffi."""
    env = os.environ.get("JAXBRIDGE_CACHE_DIR")
    return pathlib.Path(env).expanduser() if env else pathlib.Path("~/.cache/nvalchemi_jaxbridge/ffi").expanduser()


def _cuda_include_dirs() -> list[str]:
    """CUDA header directories for torch's c10/cuda headers, or [] when none are found.

    Looked for in CUDA_HOME, CUDA_PATH, torch's CUDA_HOME, /usr/local/cuda*, then the
    include folders of pip's nvidia-* packages and of Triton's NVIDIA backend. The first
    folder holding both cuda_runtime_api.h and crt/host_config.h wins; else one folder
    for each, where both are found.
    """
    cpp_extension = _cpp_extension()

    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), getattr(cpp_extension, "CUDA_HOME", None),
             "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
    cands = [os.path.join(h, "include") for h in homes if h]
    for p in sys.path:
        cands += sorted(glob.glob(os.path.join(p, "nvidia", "*", "include")))
        cands.append(os.path.join(p, "triton", "backends", "nvidia", "include"))
    runtime = [d for d in cands if os.path.isfile(os.path.join(d, "cuda_runtime_api.h"))]
    crt = [d for d in cands if os.path.isfile(os.path.join(d, "crt", "host_config.h"))]
    both = [d for d in runtime if d in crt]
    if both:
        return both[:1]
    return [runtime[0], crt[0]] if runtime and crt else []


def _cpp_extension() -> Any:
    """`torch.utils.cpp_extension` (for its include paths), imported without its import-time warning.

    On a machine without a CUDA runtime torch logs "No CUDA runtime is found" when the
    module is first imported; the FFI build only reads paths from it, so that line
    would be noise in every user's output.
    """
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        log.setLevel(level)
    return cpp_extension


def _cxx_std() -> str:
    """The C++ standard torch's extension builder asks for (c++20 from torch 2.10 on, else c++17)."""
    import inspect

    cpp_extension = _cpp_extension()
    try:
        src = inspect.getsource(cpp_extension)
    except (OSError, TypeError):
        src = ""
    return "c++20" if "-std=c++20" in src else "c++17"


def _compiler_version(compiler: str) -> str:
    try:
        res = subprocess.run([*shlex.split(compiler), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelError(
            f"cannot run the C++ compiler {compiler!r} to build the FFI call path ({e}); install g++ "
            f"or point $CXX at a C++ compiler. {FALLBACK}"
        ) from None
    return (res.stdout or res.stderr).splitlines()[0] if (res.stdout or res.stderr) else compiler


def config() -> BuildConfig:
    """The build configuration for this process's torch, jax and compiler."""
    import jax
    import jaxlib
    import torch

    cpp_extension = _cpp_extension()
    compiler = os.environ.get("CXX") or "c++"
    # Python's headers: the handler clears a Python error torch's autograd engine leaves set
    includes = [*cpp_extension.include_paths(), jax.ffi.include_dir(), sysconfig.get_paths()["include"]]
    cuda_dirs = _cuda_include_dirs() if torch.version.cuda else []
    lib_dir = str(pathlib.Path(torch.__file__).parent / "lib")
    cuda = bool(cuda_dirs) and os.path.exists(os.path.join(lib_dir, "libc10_cuda.so"))
    return BuildConfig(
        compiler=compiler,
        compiler_version=_compiler_version(compiler),
        include_dirs=tuple(includes + (cuda_dirs if cuda else [])),
        lib_dir=lib_dir,
        cuda=cuda,
        cxx_std=_cxx_std(),
        abi=int(torch._C._GLIBCXX_USE_CXX11_ABI),
        versions=(f"torch {torch.__version__}", f"jax {jax.__version__}", f"jaxlib {jaxlib.__version__}"),
    )


def build(cfg: BuildConfig | None = None, *, quiet: bool = False) -> pathlib.Path:
    """The compiled library for `cfg` (default: this process's), built now unless already cached.

    Args:
        cfg: the configuration (default `config()`).
        quiet: no progress lines (they go to the `logging` logger of this module: the start at WARNING, so it
            shows by default, the time taken at INFO).

    Returns:
        The path of the shared library.

    Raises:
        KernelError: the compiler failed; the message has its command and the tail of its output.
    """
    cfg = cfg or config()
    target_dir = cache_root() / cfg.key()
    lib = target_dir / LIB_NAME
    if lib.is_file():
        return lib
    target_dir.mkdir(parents=True, exist_ok=True)
    with open(target_dir / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait, then reuse
        try:
            if lib.is_file():
                return lib
            tmp = target_dir / f".{LIB_NAME}.{os.getpid()}.tmp"
            cmd = cfg.command(tmp)
            if not quiet:
                # WARNING, so that a user sees why this first call waits (once per machine and versions)
                _log.warning("compiling the torch FFI call path into %s (once per machine and torch/jax versions; "
                             "about %d s)", target_dir, EXPECTED_SECONDS)
            t0 = time.perf_counter()
            try:
                res = subprocess.run(cmd, capture_output=True, text=True)
            except OSError as e:
                res = subprocess.CompletedProcess(cmd, 127, "", str(e))
            if res.returncode != 0:
                tmp.unlink(missing_ok=True)
                tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-25:])
                raise KernelError(
                    f"building the FFI call path failed (exit {res.returncode}).\ncommand: {shlex.join(cmd)}\n"
                    f"output (last lines):\n{tail}\nFix the compiler setup (a C++20 g++/clang++ and torch's "
                    f"headers), or {FALLBACK}"
                )
            os.replace(tmp, lib)
            if not quiet:
                _log.info("compiled the torch FFI call path in %.1f s", time.perf_counter() - t0)
            return lib
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
