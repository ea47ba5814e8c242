// SPDX-License-Identifier: Apache-2.0
// The service benchmark's markdown report: the loopback ceilings beside lossd's transfers, the
// server's compute time per shape, end to end per micro-batch against its bound, and the
// targets with pass/fail. Formats what was measured; measures nothing and calls no server.
#ifndef LOSSD_BENCH_SERVICE_REPORT_H_
#define LOSSD_BENCH_SERVICE_REPORT_H_

#include <map>
#include <string>
#include <vector>

#include "bench/service/bench_common.h"

namespace lossd {
namespace bench {

// The key=value lines net_ceiling --client wrote (GB/s and bytes per run); empty for "".
std::map<std::string, double> ReadCeilings(const std::string& path);

// The whole report, `header` first. `points` in display order; `busy_clients`: the clients
// of the GPU-busy point.
std::string Report(const std::string& header, const std::map<std::string, double>& ceil,
                   const std::vector<Transfer>& transfers, const std::vector<Point>& points,
                   const Env& env, int busy_clients);

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_SERVICE_REPORT_H_
