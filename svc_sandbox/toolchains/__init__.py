"""One module per toolchain behind one interface (`base.Toolchain.evaluate`): how a
candidate of that toolchain is built and what its measured session runs. What the service
believes about the session is in trust.py, the same for all of them."""

from leap.common.v1 import common_pb2
from svc_sandbox.toolchains.cpu import CpuToolchain
from svc_sandbox.toolchains.cuda import CudaToolchain
from svc_sandbox.toolchains.kernelbench import KernelbenchToolchain

TOOLCHAINS = {common_pb2.Toolchain.TOOLCHAIN_CPU: CpuToolchain, common_pb2.Toolchain.TOOLCHAIN_CUDA: CudaToolchain,
              common_pb2.Toolchain.TOOLCHAIN_KERNELBENCH: KernelbenchToolchain}
