#include "server/http_endpoint.h"

#include <CivetServer.h>
#include <prometheus/text_serializer.h>

#include <cstring>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace kvtier {
namespace {

void Respond(mg_connection* conn, int code, const char* reason, const char* content_type,
             const std::string& body, bool head = false) {
  mg_printf(conn,
            "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
            "Connection: close\r\n%s\r\n",
            code, reason, content_type, body.size(),
            code == 405 ? "Allow: GET, HEAD\r\n" : "");
  if (!head) mg_write(conn, body.data(), body.size());
}

// civetweb matches a handler's path as a prefix; ours answer their exact path only.
bool IsExactly(mg_connection* conn, const char* path) {
  const mg_request_info* info = mg_get_request_info(conn);
  return info != nullptr && info->local_uri != nullptr && std::strcmp(info->local_uri, path) == 0;
}

}  // namespace

// One path, GET and HEAD; any other method is 405, any longer path 404.
class HttpEndpoint::PathHandler : public CivetHandler {
 public:
  PathHandler(const char* path, std::function<void(mg_connection*, bool head)> respond)
      : path_(path), respond_(std::move(respond)) {}
  bool handleGet(CivetServer*, mg_connection* conn) override { return Serve(conn, false); }
  bool handleHead(CivetServer*, mg_connection* conn) override { return Serve(conn, true); }
  bool handlePost(CivetServer*, mg_connection* conn) override { return Refuse(conn); }
  bool handlePut(CivetServer*, mg_connection* conn) override { return Refuse(conn); }
  bool handleDelete(CivetServer*, mg_connection* conn) override { return Refuse(conn); }
  bool handlePatch(CivetServer*, mg_connection* conn) override { return Refuse(conn); }
  bool handleOptions(CivetServer*, mg_connection* conn) override { return Refuse(conn); }

 private:
  bool Serve(mg_connection* conn, bool head) {
    if (!IsExactly(conn, path_)) return NotFound(conn, head);
    respond_(conn, head);
    return true;
  }
  bool Refuse(mg_connection* conn) {
    if (!IsExactly(conn, path_)) return NotFound(conn, false);
    Respond(conn, 405, "Method Not Allowed", "text/plain", "GET or HEAD only\n");
    return true;
  }
  static bool NotFound(mg_connection* conn, bool head) {
    Respond(conn, 404, "Not Found", "text/plain", "not found\n", head);
    return true;
  }

  const char* const path_;
  const std::function<void(mg_connection*, bool head)> respond_;
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
  HttpEndpoint* e = endpoint.get();
  endpoint->metrics_handler_ =
      std::make_unique<PathHandler>("/metrics", [e](mg_connection* conn, bool head) {
        Respond(conn, 200, "OK", "text/plain; version=0.0.4; charset=utf-8", e->RenderMetrics(),
                head);
      });
  endpoint->health_handler_ =
      std::make_unique<PathHandler>("/healthz", [e](mg_connection* conn, bool head) {
        if (e->serving_()) {
          Respond(conn, 200, "OK", "text/plain", "ok\n", head);
        } else {
          Respond(conn, 503, "Service Unavailable", "text/plain", "not serving\n", head);
        }
      });
  // civetweb gives each connection a thread until its request is read: a client that
  // connects and goes quiet holds one for request_timeout_ms (30 s by default). With
  // two threads, two such clients took /healthz and /metrics down. Threads to spare
  // and a request timeout a scrape never needs bound what idle clients can hold.
  const std::vector<std::string> options = {
      "listening_ports", listen, "num_threads", std::to_string(kThreads),
      "request_timeout_ms", std::to_string(absl::ToInt64Milliseconds(kRequestTimeout))};
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
