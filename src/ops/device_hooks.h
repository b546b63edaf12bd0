// device_hooks.h — the device hooks of the specs (src/ops/cuda/), for the spec files to name:
// declared in a build with the CUDA backend, absent otherwise. TPNORM_DEVICE_HOOKS(p, a) is
// `DeviceHooks<Args>{p, a}` with the backend and `{}` (no device kernels: run_op fails such a
// call on a device communicator) without it, so a spec file spells its hooks once:
//   constexpr DeviceHooks<MyArgs> kDevice = TPNORM_DEVICE_HOOKS(my_partial_cuda, my_apply_cuda);
// TPNORM_DEVICE_CHUNK_HOOKS adds the row-chunk forms (OpSpec::partial_rows / apply_rows).
// The _EXACT forms also declare that the hooks run Stats::kExact (OpSpec::has_device_exact).
#pragma once

#include "ops/op_spec.h"

#ifdef TPNORM_WITH_CUDA
#include "ops/cuda/batch_norm_cuda.h"
#include "ops/cuda/fused_cuda.h"
#include "ops/cuda/group_norm_cuda.h"
#include "ops/cuda/rms_norm_gated_cuda.h"
#include "ops/cuda/row_chunks_cuda.h"
#include "ops/cuda/row_norm_cuda.h"
#define TPNORM_DEVICE_HOOKS(partial, apply) \
  { partial, apply }
#define TPNORM_DEVICE_CHUNK_HOOKS(partial, apply, partial_rows, apply_rows) \
  { partial, apply, partial_rows, apply_rows }
#define TPNORM_DEVICE_HOOKS_EXACT(partial, apply) \
  { partial, apply, nullptr, nullptr, true }
#define TPNORM_DEVICE_CHUNK_HOOKS_EXACT(partial, apply, partial_rows, apply_rows) \
  { partial, apply, partial_rows, apply_rows, true }
#else
#define TPNORM_DEVICE_HOOKS(partial, apply) \
  {}
#define TPNORM_DEVICE_CHUNK_HOOKS(partial, apply, partial_rows, apply_rows) \
  {}
#define TPNORM_DEVICE_HOOKS_EXACT(partial, apply) \
  {}
#define TPNORM_DEVICE_CHUNK_HOOKS_EXACT(partial, apply, partial_rows, apply_rows) \
  {}
#endif
