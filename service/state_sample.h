// SPDX-License-Identifier: Apache-2.0
// The engine's state as the gauges /metrics reads on each scrape (ServerMetrics' sampler).
#ifndef LOSSD_SERVICE_STATE_SAMPLE_H_
#define LOSSD_SERVICE_STATE_SAMPLE_H_

#include "engine/engine.h"
#include "service/metrics.h"

namespace lossd {

StateSample SampleState(Engine& engine);

}  // namespace lossd

#endif  // LOSSD_SERVICE_STATE_SAMPLE_H_
