// SPDX-License-Identifier: Apache-2.0
#include "client/request_views.h"

#include <optional>
#include <utility>

#include "client/client_types.h"
#include "client/host_tensor.h"

namespace lossd {
namespace client {

HostTensor ViewOf(const HostTensor& t) {
  return t.is_view() ? t : HostTensor::View(t.dtype(), t.shape(), t.data());
}

std::optional<HostTensor> ViewOf(const std::optional<HostTensor>& t) {
  if (!t) return std::nullopt;
  return ViewOf(*t);
}

HostTensor CopyOf(const HostTensor& t) {
  ByteVector bytes(t.data(), t.data() + t.num_bytes());
  return HostTensor::FromBytes(t.dtype(), t.shape(), std::move(bytes));
}

ComputeRequest ViewsOf(const ComputeRequest& r) {
  ComputeRequest out;
  out.x = ViewOf(r.x);
  out.w = ViewOf(r.w);
  out.weight_handle = r.weight_handle;
  out.bias = ViewOf(r.bias);
  out.targets = ViewOf(r.targets);
  out.class_weights = ViewOf(r.class_weights);
  out.grad_output = ViewOf(r.grad_output);
  out.options = r.options;
  out.grad_dtype = r.grad_dtype;
  out.want = r.want;
  out.accumulator = r.accumulator;
  out.output_into = r.output_into;
  out.head = r.head;
  out.head_version = r.head_version;
  out.rank = r.rank;
  out.micro_batch = r.micro_batch;
  out.overlap = r.overlap;
  out.kind = r.kind;
  out.dlogp = ViewOf(r.dlogp);
  out.dentropy = ViewOf(r.dentropy);
  out.advantages = ViewOf(r.advantages);
  out.old_logp = ViewOf(r.old_logp);
  out.ref_logp = ViewOf(r.ref_logp);
  out.is_ratio = ViewOf(r.is_ratio);
  out.policy = r.policy;
  out.teacher_x = ViewOf(r.teacher_x);
  out.teacher_w = ViewOf(r.teacher_w);
  out.teacher_bias = ViewOf(r.teacher_bias);
  out.teacher_weight_handle = r.teacher_weight_handle;
  out.teacher_topk_ids = ViewOf(r.teacher_topk_ids);
  out.teacher_topk_logp = ViewOf(r.teacher_topk_logp);
  out.distill = r.distill;
  out.keep_ms = r.keep_ms;
  out.ticket = r.ticket;
  return out;
}

}  // namespace client
}  // namespace lossd
