"""``python -m mpzero.info``: what this installation of mpzero can do."""

from __future__ import annotations

import platform


def extension_status() -> tuple[bool, str]:
    """Whether ``mpzero._C`` imports, and a short reason when it does not."""
    try:
        from mpzero import _C  # noqa: F401
    except ImportError as e:
        return False, str(e)
    return True, _C.__file__


def cpu_extension_status() -> tuple[bool, str]:
    """Whether ``mpzero._cpu`` (the CPU Adam) imports, and a short reason when it does not."""
    try:
        from mpzero import _cpu  # noqa: F401
    except ImportError as e:
        return False, str(e)
    return True, _cpu.__file__


def report() -> str:
    """A human-readable report: versions, extension, backends, devices."""
    import torch
    import torch.distributed as dist

    import mpzero

    built, where = extension_status()
    cpu_built, cpu_where = cpu_extension_status()
    from mpzero.kernels import cpu_adam

    cpu_kernel = (f"mpzero._cpu, {cpu_adam.get_threads()} threads" if cpu_adam.available()
                  else "torch fused Adam (fp32), PyTorch reference (other modes)")
    lines = [
        f"mpzero          {mpzero.__version__}",
        f"python          {platform.python_version()}",
        f"torch           {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})",
        f"mpzero._C       {'built: ' + where if built else 'not built (' + where + ')'}",
        f"mpzero._cpu     {('built: ' if cpu_built else 'not built: ') + cpu_where}",
        f"kernels         {'CUDA extension for CUDA tensors' if built else 'PyTorch reference'}",
        f"cpu adam        {cpu_kernel}",
        f"distributed     {'available' if dist.is_available() else 'not available'}",
    ]
    if dist.is_available():
        backends = [
            name
            for name, ok in (
                ("gloo", dist.is_gloo_available()),
                ("nccl", dist.is_nccl_available()),
                ("mpi", dist.is_mpi_available()),
            )
            if ok
        ]
        lines.append(f"backends        {', '.join(backends) or 'none'}")
        if dist.is_nccl_available() and torch.cuda.is_available():
            lines.append(f"nccl version    {'.'.join(map(str, torch.cuda.nccl.version()))}")
    lines.append(f"cpu threads     {torch.get_num_threads()}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(
                f"cuda:{i}          {p.name}, sm_{p.major}{p.minor}, "
                f"{p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs"
            )
    else:
        lines.append("cuda devices    none")
    return "\n".join(lines)


def main() -> None:
    print(report())


if __name__ == "__main__":
    main()
