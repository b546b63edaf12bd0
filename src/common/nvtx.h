// nvtx.h — NVTX ranges around each device call and its phases, so that an Nsight Systems
// timeline (nsys profile -t cuda,nvtx) shows where a norm's time goes: one range per call named
// after the public call ("layer_norm_forward"), and inside it "partial", "collective" and
// "apply". All in the "tpnorm" domain.
//
// NVTX3 is header-only: with no profiler attached, the first NVTX call finds no injection
// library and every later call is a call through a no-op function pointer. Nothing here
// allocates or formats: messages are string literals (the op's name, the phase names), passed
// by pointer. Without the CUDA backend every type here is empty and does nothing.
//
// A call's range is a start/end range, not push/pop: a split-phase call (tpnorm/split.h)
// starts in one place of the caller's code and finishes in another, with the caller's own
// ranges in between. Phases are push/pop ranges inside one function of the runner.
#pragma once

#include <cstdint>

#ifdef TPNORM_WITH_CUDA
#include <nvtx3/nvToolsExt.h>
#endif

namespace tpnorm::detail::nvtx {

#ifdef TPNORM_WITH_CUDA

inline nvtxDomainHandle_t domain() {
  static const nvtxDomainHandle_t d = nvtxDomainCreateA("tpnorm");
  return d;
}

inline nvtxEventAttributes_t attributes(const char* message) {
  nvtxEventAttributes_t a{};
  a.version = NVTX_VERSION;
  a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
  a.messageType = NVTX_MESSAGE_TYPE_ASCII;
  a.message.ascii = message;
  return a;
}

/// The range of one call, from its start to its finish (or its destruction: a start that
/// threw, a split-phase handle dropped). `name` null: no range (host calls).
class CallRange {
 public:
  explicit CallRange(const char* name) {
    if (!name) return;
    const nvtxEventAttributes_t a = attributes(name);
    id_ = nvtxDomainRangeStartEx(domain(), &a);
    open_ = true;
  }
  ~CallRange() { end(); }
  CallRange(const CallRange&) = delete;
  CallRange& operator=(const CallRange&) = delete;
  void end() {
    if (open_) nvtxDomainRangeEnd(domain(), id_);
    open_ = false;
  }
  bool active() const { return open_; }

 private:
  nvtxRangeId_t id_ = 0;
  bool open_ = false;
};

/// A phase of a traced call, pushed and popped in one scope.
class Phase {
 public:
  Phase(const CallRange& call, const char* name) : on_(call.active()) {
    if (!on_) return;
    const nvtxEventAttributes_t a = attributes(name);
    nvtxDomainRangePushEx(domain(), &a);
  }
  ~Phase() {
    if (on_) nvtxDomainRangePop(domain());
  }
  Phase(const Phase&) = delete;
  Phase& operator=(const Phase&) = delete;

 private:
  bool on_;
};

#else

class CallRange {
 public:
  explicit CallRange(const char*) {}
  void end() {}
};
class Phase {
 public:
  Phase(const CallRange&, const char*) {}
};

#endif

}  // namespace tpnorm::detail::nvtx
