// instantiate.h — the type combinations the CPU kernels are compiled for: every storage type T
// (float, f16, bf16) with every wire type W and saved-statistics type S (float, double), the
// combinations detail::dispatch_kernel_types can ask for.
//
// A kernel file defines a macro per signature shape and lists it once:
//   #define MY_WS(T, W, S) template void my_apply<T, W, S>(...);
//   #define MY(T) template void my_partial<T, float>(...); ... TPNORM_FOR_EACH_WS(MY_WS, T)
//   TPNORM_FOR_EACH_STORAGE(MY)
#pragma once

#include "common/half.h"

#define TPNORM_FOR_EACH_W(M, T) M(T, float) M(T, double)
#define TPNORM_FOR_EACH_WS(M, T) \
  M(T, float, float) M(T, float, double) M(T, double, float) M(T, double, double)
#define TPNORM_FOR_EACH_STORAGE(M) M(float) M(f16) M(bf16)
