"""Fake CUDA on a CPU-only build, for the tests: ``refengine.tools.fake_cuda`` (the package holds it, so
``refengine bench --fake-cuda`` can use it too)."""

from refengine.tools.fake_cuda import (  # noqa: F401 - re-exported for the tests
    CUDA,
    DeviceWatch,
    FakeCuda,
    NoCudaGuard,
    OpRecord,
    install_cuda_guard,
    storage_key,
)
