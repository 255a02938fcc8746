"""Compile every Triton kernel launch of the interpreter test cases for a GPU target, on a machine without a GPU.

The interpreter cases (tests/triton_interpreter_cases.py, tests/attention_interpreter_cases.py) launch each Triton
kernel of pithtrain/ops with real arguments. This script runs them with TRITON_INTERPRET=1, records every distinct
launch (the signature from the arguments: tensors' dtypes, integers, tensor descriptors' blocks; the constexprs and
num_warps / num_stages as given), then compiles each for the target (sm90: Hopper, by default) through Triton's
real compiler in a second process (the interpreter's patches of triton.language outlive the kernels it runs). A kernel that the interpreter runs but the GPU compiler refuses
(an unsupported op, a constexpr misuse, a device function's arguments) FAILs here, before any device time is spent.

    PYTHONPATH=. python .agents/skills/compile-kernels/compile_kernels.py [--arch 90] [-k PYTEST_EXPR]

Ends with PASS (every distinct specialization compiled) or FAIL (each failure's kernel, constexprs and error).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "_common"))
import runs  # noqa: E402


TORCH_TO_TRITON = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int64": "i64",
                   "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1",
                   "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}
OPTIONS = ("num_warps", "num_stages", "num_ctas")


def signature_of(jit_fn, args, kwargs):
    """(signature, constexprs, options) of a launch: each parameter's Triton type from its argument."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    values = dict(zip(jit_fn.arg_names, args))
    values.update({k: v for k, v in kwargs.items() if k not in OPTIONS})
    signature, constexprs = {}, {}
    for param in jit_fn.params:
        name, value = param.name, values.get(param.name, param.default)
        if param.is_constexpr or value is None:
            signature[name] = "constexpr"
            constexprs[name] = value
        elif isinstance(value, TensorDescriptor):
            dtype = TORCH_TO_TRITON[str(value.base.dtype).removeprefix("torch.")]
            signature[name] = f"tensordesc<{dtype}[{', '.join(str(b) for b in value.block_shape)}]>"
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TORCH_TO_TRITON[str(value.dtype).removeprefix("torch.")]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{name}: no Triton type for {type(value).__name__}")
    return signature, constexprs, {k: kwargs[k] for k in OPTIONS if k in kwargs}


class Collector:
    """Records each distinct launch (kernel, signature, constexprs, options) while the interpreter runs them."""

    def __init__(self):
        self.launches = {}

    def __call__(self, fn, args, kwargs):
        from triton.runtime.jit import JITFunction

        signature, constexprs, options = signature_of(JITFunction(fn), args, kwargs)
        entry = {"module": fn.__module__, "kernel": fn.__name__, "signature": signature, "constexprs": constexprs,
                 "options": options}
        self.launches.setdefault(json.dumps(entry, sort_keys=True), entry)


def compile_all(path: str, arch: int) -> int:
    """In a process without the interpreter (its patches of triton.language outlive a kernel's run): compile each
    recorded launch for sm<arch>; print a line per failure and the count."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    target, failures = GPUTarget("cuda", arch, 32), 0
    print(f"triton {triton.__version__}")
    for entry in json.load(open(path)):
        module = importlib.import_module(entry["module"])
        kernel = getattr(module, entry["kernel"])
        fn = getattr(kernel, "fn", kernel)  # a _Kernel's plain function, or the function itself
        fn.__globals__["tl"] = triton.language
        real, constexprs = JITFunction(fn), entry["constexprs"]
        try:
            src = ASTSource(real, entry["signature"],
                            constexprs={(real.arg_names.index(n),): v for n, v in constexprs.items()})
            triton.compile(src, target=target, options=entry["options"])
        except Exception as e:  # any refusal of the compiler is the finding
            lines = [line for line in str(e).strip().splitlines() if line.strip()]
            shown = {k: v for k, v in constexprs.items() if v is not None}
            print(f"  {entry['kernel']} {shown} {entry['options']}: {type(e).__name__} "
                  f"{' | '.join(lines[:1] + lines[-3:])}"[:700])
            failures += 1
    print(f"failures: {failures}")
    return 0


@runs.interruptible
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=runs.number(int, low=70, high=121), default=90,  # past sm_121: no such GPU yet
                        help="compute capability x 10 (90: H100/H200)")
    parser.add_argument("-k", dest="expr", help="pytest -k expression: only these interpreter cases")
    parser.add_argument("--triton", metavar="DIR", help="compile with the Triton installed in DIR (the GPU image's "
                        "version: pip install --no-deps --target DIR triton==3.6.0); default: this environment's")
    parser.add_argument("--compile", metavar="FILE", help=argparse.SUPPRESS)  # the second process's part
    args = parser.parse_args()
    if args.compile:
        return compile_all(args.compile, args.arch)
    if args.triton and not (Path(args.triton) / "triton" / "__init__.py").is_file():
        return runs.verdict(False, f"--triton {args.triton}: no triton package there (pip install --no-deps "
                                   f"--target {args.triton} triton==VERSION)")
    os.environ["TRITON_INTERPRET"] = "1"  # this process runs the interpreter: set before triton is imported
    try:
        import pytest
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError as e:
        return runs.verdict(False, f"needs pytest and Triton with its NVIDIA backend ({e})")
    from pithtrain.ops import kernels

    collector = Collector()
    launch = kernels._Kernel.__getitem__

    def recording(self, grid):
        run = launch(self, grid)
        return lambda *a, **kw: (collector(self.fn, a, kw), run(*a, **kw))[1]

    kernels._Kernel.__getitem__ = recording
    began = time.time()
    tests = Path(__file__).resolve().parents[3] / "tests"  # the checkout's, from any working directory
    cases = [str(tests / "triton_interpreter_cases.py"), str(tests / "attention_interpreter_cases.py"), "-q", "-p",
             "no:cacheprovider", "-W", "ignore"] + (["-k", args.expr] if args.expr else [])
    code = pytest.main(cases)
    if code == 5:
        return runs.verdict(False, f"-k {args.expr!r} selects no interpreter case (list them: pytest --collect-only -q "
                                   "tests/triton_interpreter_cases.py tests/attention_interpreter_cases.py)")
    if code == 4:  # pytest's usage error: the expression itself
        return runs.verdict(False, f"-k {args.expr!r} is not a pytest -k expression (its message is above), e.g. -k 'cross_entropy'")
    if code != 0 or not collector.launches:
        return runs.verdict(False, "no kernel launched" if code == 0 else f"the interpreter cases failed (pytest exit {code})")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(list(collector.launches.values()), f)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if args.triton:
        env["PYTHONPATH"] = os.pathsep.join([args.triton, env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, __file__, "--arch", str(args.arch), "--compile", f.name], env=env,
                         capture_output=True, text=True)
    version = next((line.split()[-1] for line in out.stdout.splitlines() if line.startswith("triton ")), "?")
    os.unlink(f.name)
    report = [line for line in out.stdout.splitlines() if line.startswith("  ") or line.startswith("failures:")]
    failures = int(report[-1].split()[1]) if report and report[-1].startswith("failures:") else -1
    print(f"compiled {len(collector.launches)} distinct kernel launches for sm{args.arch} with Triton {version} in "
          f"{time.time() - began:.0f} s")
    print("\n".join(line for line in report if line.startswith("  ")))
    if failures:
        return runs.verdict(False, f"{failures} compile failures" if failures > 0 else
                            f"the compiling process died (exit {out.returncode}): {out.stderr.strip()[-600:]}")
    return runs.verdict(True, f"{len(collector.launches)} kernel specializations compile for sm{args.arch}")


if __name__ == "__main__":
    sys.exit(main())
