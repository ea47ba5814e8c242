// SPDX-License-Identifier: Apache-2.0
#include "service/reflection_guard.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include <grpc/grpc.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/impl/server_builder_plugin.h>
#include <grpcpp/support/server_interceptor.h>

#include "absl/strings/match.h"

namespace lossd {
namespace {

// The name the reflection plugin gives itself (ServerBuilderPlugin::name).
constexpr char kReflectionPlugin[] = "proto_server_reflection";
// Every reflection method's full name starts so (v1alpha, and v1 in later gRPC releases).
constexpr char kReflectionMethods[] = "/grpc.reflection.";

// Keeps at most one reflection plugin when reflection is on (the library's own registration
// and InitProtoReflectionServerBuilderPlugin could each add one), none when it is off.
class ReflectionPluginOption final : public grpc::ServerBuilderOption {
 public:
  explicit ReflectionPluginOption(bool keep) : keep_(keep) {}
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    bool kept = false;
    auto drop = [&](const std::unique_ptr<grpc::ServerBuilderPlugin>& p) {
      if (p->name() != kReflectionPlugin) return false;
      if (keep_ && !kept) {
        kept = true;
        return false;
      }
      return true;
    };
    plugins->erase(std::remove_if(plugins->begin(), plugins->end(), drop), plugins->end());
  }

 private:
  const bool keep_;
};

// Refuses a reflection call without a valid token once its metadata is in, before the
// reflection handler reads a request. The handler is gRPC's own (synchronous, not ours to
// change), so the call is ended from below it: cancelled with UNAUTHENTICATED, which the
// client receives as the call's status; the handler's reads then fail and it returns.
class ReflectionAuthInterceptor final : public grpc::experimental::Interceptor {
 public:
  ReflectionAuthInterceptor(grpc::experimental::ServerRpcInfo* info,
                            std::shared_ptr<const TokenAuthenticator> auth)
      : info_(info), auth_(std::move(auth)) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      const absl::Status s = auth_->Check(*methods->GetRecvInitialMetadata());
      if (!s.ok()) {
        const std::string message(s.message());  // never holds the token
        grpc_call_cancel_with_status(info_->server_context()->c_call(),
                                     GRPC_STATUS_UNAUTHENTICATED, message.c_str(), nullptr);
      }
    }
    methods->Proceed();
  }

 private:
  grpc::experimental::ServerRpcInfo* info_;
  std::shared_ptr<const TokenAuthenticator> auth_;
};

class ReflectionAuthFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit ReflectionAuthFactory(std::shared_ptr<const TokenAuthenticator> auth)
      : auth_(std::move(auth)) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    // No interceptor at all for other calls: gRPC then runs none on their batches.
    if (!absl::StartsWith(info->method(), kReflectionMethods)) return nullptr;
    return new ReflectionAuthInterceptor(info, auth_);
  }

 private:
  std::shared_ptr<const TokenAuthenticator> auth_;
};

}  // namespace

void ConfigureReflection(grpc::ServerBuilder* builder, bool enabled,
                         std::shared_ptr<const TokenAuthenticator> auth) {
  if (enabled) grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  builder->SetOption(std::make_unique<ReflectionPluginOption>(enabled));
  if (!enabled || auth == nullptr) return;
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
  creators.push_back(std::make_unique<ReflectionAuthFactory>(std::move(auth)));
  builder->experimental().SetInterceptorCreators(std::move(creators));
}

}  // namespace lossd
