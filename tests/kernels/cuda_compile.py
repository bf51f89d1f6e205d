"""Triton kernel variants compiled for NVIDIA GPUs on a machine without one.

Triton's compiler and ptxas ship in its wheel, so a variant the interpreter ran on CPU can be
built for a GPU architecture here: a kernel the interpreter accepts but a GPU build rejects,
or one whose tiles need more shared memory than the GPU has, fails on CPU rather than on a
lent GPU. Kernels defined under TRITON_INTERPRET cannot be compiled, so the build runs in a
process without it:

    python -m tests.kernels.cuda_compile VARIANTS.json ARCH...   # one JSON line per variant

VARIANTS.json holds `variant()`s: a recorded launch (`specializations.Launch`) as the
signature, constexprs, specialisation attributes and launch options the JIT would compile.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from tests.kernels.specializations import Launch

# Shared memory a block may use (KB * 1024): Hopper 227 KB, Ampere (A100) 163 KB.
SHARED_LIMIT = {90: 232448, 80: 166912}


def variant(launch: Launch) -> dict[str, Any]:
    """A recorded launch as the JIT's compile inputs. UPCAST (and the dot precision it forces)
    is the interpreter's bf16 workaround: a GPU compiles those tiles as they are."""
    module, name, (runtime, constexpr_key) = launch
    signature, constexprs, attrs, options = {}, {}, {}, {}
    for param, type_, spec in runtime:
        signature[param] = type_
        if type_ == "constexpr":  # an integer 1, specialised to a constant
            constexprs[param] = spec
        elif isinstance(spec, str):
            attrs[param] = spec
    for key, value in constexpr_key:
        if key in ("num_warps", "num_stages"):
            options[key] = value
        else:
            signature[key] = "constexpr"
            constexprs[key] = value
    if constexprs.get("UPCAST"):
        constexprs.update(UPCAST=False, DOT_PREC="tf32")
    return {"module": module, "kernel": name, "signature": signature, "constexprs": constexprs, "attrs": attrs,
            "options": options}


def compile_variant(desc: dict[str, Any], arch: int) -> dict[str, Any]:
    """Build one variant for sm_`arch`: its shared memory, registers and spill (local) bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    kernel = getattr(importlib.import_module(desc["module"]), desc["kernel"])
    params = list(inspect.signature(kernel.fn).parameters)
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    signature = {p: desc["signature"][p] for p in params}
    constexprs = {(params.index(p),): v for p, v in desc["constexprs"].items()}
    attrs = {(params.index(p),): backend.parse_attr(spec) for p, spec in desc["attrs"].items()}
    options = backend.parse_options(dict(desc["options"])).__dict__
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options)
    return {"kernel": desc["kernel"], "arch": arch, "shared": compiled.metadata.shared,
            **_resource_usage(compiled.asm["cubin"])}


def _resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers and local (spilled) bytes of a cubin's kernel, as cuobjdump reports them."""
    import triton.backends.nvidia as nvidia

    cuobjdump = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    usage = {}
    for field, name in (("REG", "registers"), ("LOCAL", "local_bytes")):
        value = text.split(f"{field}:", 1)[1].split()[0] if f"{field}:" in text else "0"
        usage[name] = int(value.rstrip(","))
    return usage


def compile_all(variants: list[dict[str, Any]], archs: tuple[int, ...]) -> list[dict[str, Any]]:
    """Each variant built for each arch in a fresh process without TRITON_INTERPRET, one
    process an arch, side by side (each is one core's work): a result per build, with `error`
    where it failed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the GPU runs' setting (Triton's default so far)
    results: list[dict[str, Any]] = []
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(variants, f)
        f.flush()
        procs = [subprocess.Popen([sys.executable, "-m", "tests.kernels.cuda_compile", f.name, str(arch)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                  cwd=_repo_root()) for arch in archs]
        for proc in procs:
            stdout, stderr = proc.communicate()
            built = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
            if len(built) != len(variants):
                raise RuntimeError(f"compile process exited {proc.returncode}: {stderr[-3000:]}")
            results += built
    return results


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(path: str, archs: list[str]) -> None:
    with open(path) as f:
        variants = json.load(f)
    for desc in variants:
        for arch in map(int, archs):
            try:
                result = compile_variant(desc, arch)
            except Exception as exc:  # noqa: BLE001 - reported per variant, the test fails on it
                result = {"kernel": desc["kernel"], "arch": arch, "error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(json.dumps({**result, "constexprs": desc["constexprs"]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
