// SPDX-License-Identifier: Apache-2.0
// One measured point of the service benchmark: `clients` threads, each with its own
// connection, computing one shape in one mode (W inline, by handle, or into an accumulator
// with or without the per-step striped fetch). Times calls and steps; never checks results.
#ifndef LOSSD_BENCH_SERVICE_RUN_POINT_H_
#define LOSSD_BENCH_SERVICE_RUN_POINT_H_

#include <cstdint>
#include <string>

#include "bench/service/bench_common.h"

namespace lossd {
namespace bench {

// Runs one point: `clients` threads, each with its own connection(s), one untimed warm-up
// call (or step), then env.runs timed calls (steps) between two barriers.
Point RunPoint(const Env& env, const ShapeData& d, const uint8_t* w, const std::string& handle,
               Mode mode, int clients);

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_SERVICE_RUN_POINT_H_
