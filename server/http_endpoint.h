// HttpEndpoint: the operator's HTTP port. GET /metrics returns every registered
// collectable in the Prometheus text format; GET /healthz returns 200 "ok" while the
// daemon serves and 503 otherwise (starting up, shutting down). HEAD answers the same
// headers; other methods get 405, other paths 404. Runs on civetweb (the HTTP server
// prometheus-cpp itself builds on) with kThreads threads.
//
// Thread-safety: handlers run on civetweb's threads; `serving` must be thread-safe.
// AddCollectable may be called at any time (the store's collector arrives after the
// store has recovered, while /healthz already answers). Collectables must outlive the
// endpoint.
#ifndef KVTIER_SERVER_HTTP_ENDPOINT_H_
#define KVTIER_SERVER_HTTP_ENDPOINT_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <prometheus/collectable.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

class CivetServer;

namespace kvtier {

class HttpEndpoint {
 public:
  // Listens on `listen` (host:port; port 0 picks one). Errors: Unavailable (cannot bind).
  static absl::StatusOr<std::unique_ptr<HttpEndpoint>> Start(const std::string& listen,
                                                             std::function<bool()> serving);
  ~HttpEndpoint();

  void AddCollectable(const prometheus::Collectable* collectable);

  int port() const { return port_; }
  // The /metrics body, also used by tests without HTTP.
  std::string RenderMetrics() const;

  // civetweb's threads, and how long one waits for a request's headers.
  static constexpr int kThreads = 8;
  static constexpr absl::Duration kRequestTimeout = absl::Seconds(5);

 private:
  class PathHandler;
  explicit HttpEndpoint(std::function<bool()> serving);

  const std::function<bool()> serving_;
  mutable absl::Mutex mu_;
  std::vector<const prometheus::Collectable*> collectables_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<PathHandler> metrics_handler_;
  std::unique_ptr<PathHandler> health_handler_;
  // Declared last: stopped (its threads joined) before the handlers go.
  std::unique_ptr<CivetServer> server_;
  int port_ = 0;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_HTTP_ENDPOINT_H_
