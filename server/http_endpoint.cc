#include "server/http_endpoint.h"

#include <CivetServer.h>
#include <prometheus/text_serializer.h>

#include <sstream>

#include "absl/strings/str_cat.h"

namespace kvtier {
namespace {

void Respond(mg_connection* conn, int code, const char* reason, const char* content_type,
             const std::string& body) {
  mg_printf(conn,
            "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
            "Connection: close\r\n\r\n",
            code, reason, content_type, body.size());
  mg_write(conn, body.data(), body.size());
}

}  // namespace

class HttpEndpoint::MetricsHandler : public CivetHandler {
 public:
  explicit MetricsHandler(const HttpEndpoint* endpoint) : endpoint_(endpoint) {}
  bool handleGet(CivetServer*, mg_connection* conn) override {
    Respond(conn, 200, "OK", "text/plain; version=0.0.4; charset=utf-8",
            endpoint_->RenderMetrics());
    return true;
  }

 private:
  const HttpEndpoint* const endpoint_;
};

class HttpEndpoint::HealthHandler : public CivetHandler {
 public:
  explicit HealthHandler(const HttpEndpoint* endpoint) : endpoint_(endpoint) {}
  bool handleGet(CivetServer*, mg_connection* conn) override {
    if (endpoint_->serving_()) {
      Respond(conn, 200, "OK", "text/plain", "ok\n");
    } else {
      Respond(conn, 503, "Service Unavailable", "text/plain", "not serving\n");
    }
    return true;
  }

 private:
  const HttpEndpoint* const endpoint_;
};

HttpEndpoint::HttpEndpoint(std::function<bool()> serving) : serving_(std::move(serving)) {}

void HttpEndpoint::AddCollectable(const prometheus::Collectable* collectable) {
  absl::MutexLock lock(&mu_);
  collectables_.push_back(collectable);
}

HttpEndpoint::~HttpEndpoint() {
  if (server_) server_->close();
}

absl::StatusOr<std::unique_ptr<HttpEndpoint>> HttpEndpoint::Start(
    const std::string& listen, std::function<bool()> serving) {
  std::unique_ptr<HttpEndpoint> endpoint(new HttpEndpoint(std::move(serving)));
  endpoint->metrics_handler_ = std::make_unique<MetricsHandler>(endpoint.get());
  endpoint->health_handler_ = std::make_unique<HealthHandler>(endpoint.get());
  const std::vector<std::string> options = {"listening_ports", listen, "num_threads", "2"};
  try {
    endpoint->server_ = std::make_unique<CivetServer>(options);
  } catch (const CivetException& e) {
    return absl::UnavailableError(
        absl::StrCat("metrics_listen: cannot serve HTTP on ", listen, ": ", e.what()));
  }
  if (endpoint->server_->getContext() == nullptr) {
    return absl::UnavailableError(absl::StrCat("metrics_listen: cannot bind ", listen));
  }
  endpoint->server_->addHandler("/metrics", endpoint->metrics_handler_.get());
  endpoint->server_->addHandler("/healthz", endpoint->health_handler_.get());
  std::vector<int> ports = endpoint->server_->getListeningPorts();
  endpoint->port_ = ports.empty() ? 0 : ports[0];
  return endpoint;
}

std::string HttpEndpoint::RenderMetrics() const {
  std::vector<prometheus::MetricFamily> families;
  absl::MutexLock lock(&mu_);
  for (const prometheus::Collectable* c : collectables_) {
    auto more = c->Collect();
    families.insert(families.end(), std::make_move_iterator(more.begin()),
                    std::make_move_iterator(more.end()));
  }
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, families);
  return out.str();
}

}  // namespace kvtier
