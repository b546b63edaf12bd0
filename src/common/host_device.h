// host_device.h — TPNORM_HD marks a function that host and device code both call.
//
// Under nvcc it expands to __host__ __device__; in the host compiler's translation units it
// expands to nothing, so the same header serves the CPU kernels and the CUDA kernels.
#pragma once

#if defined(__CUDACC__)
#define TPNORM_HD __host__ __device__
#else
#define TPNORM_HD
#endif
