// asio_echo: the echo server and client of the runtime conformance suite on Boost.Asio, in the
// usual multi-threaded setup: one io_context run from several threads, a strand per connection
// where two operations on one socket may be in flight at once.
//
//   asio_echo server --port-file F [--host H] [--deadline S] [--threads N]
//   asio_echo client --host H --port P --test echo|rr|many [--count N] [--conns N] [--bytes N]
//
// Protocol (tests/runtimes/README.md): a connection's first byte is its command. 'E': the
// server echoes every following byte until the client's EOF, then shuts down its side and
// closes. 'Q': the server stops listening and exits once its connections are done, printing
// "OK server ...". The client prints "OK client <test>" when every reply matched byte for byte;
// anything else prints FAIL and exits non-zero. SIGALRM is the watchdog (exit 3).
#include <boost/asio.hpp>

#include <atomic>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;

namespace {

std::string host = "127.0.0.1";
int port = 0;
std::string port_file;
std::string test = "echo";
int count = 2000, nconns = 50, nbytes = 256 << 10, deadline = 40, nthreads = 4;

std::mutex err_mu;
std::string first_error;
std::atomic<int> errors{0};

void fail(const std::string &what) {
  std::lock_guard<std::mutex> g(err_mu);
  if (errors++ == 0) first_error = what;
}

extern "C" void on_alarm(int) {
  static const char msg[] = "FAIL watchdog: still running at the deadline\n";
  ssize_t r = write(1, msg, sizeof msg - 1);
  (void)r;
  _exit(3);
}

void run_threads(asio::io_context &io) {
  std::vector<std::thread> ts;
  for (int i = 1; i < nthreads; i++) ts.emplace_back([&io] { io.run(); });
  io.run();
  for (auto &t : ts) t.join();
}

// ---- server -------------------------------------------------------------------------------------

std::atomic<long> served{0};
std::atomic<unsigned long long> echoed{0};

class Server;

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket s, Server &srv) : sock_(std::move(s)), srv_(srv) {}
  void start() { read_cmd(); }

 private:
  void read_cmd();
  void read_more() {
    auto self = shared_from_this();
    sock_.async_read_some(asio::buffer(buf_), [this, self](error_code ec, std::size_t n) {
      if (ec == asio::error::eof) {
        error_code e2;
        sock_.shutdown(tcp::socket::shutdown_send, e2);
        if (e2) fail("shutdown: " + e2.message());
        return;
      }
      if (ec) {
        fail("echo read: " + ec.message());
        return;
      }
      write(0, n);
    });
  }
  void write(std::size_t off, std::size_t n) {
    auto self = shared_from_this();
    echoed += n;
    asio::async_write(sock_, asio::buffer(buf_.data() + off, n),
                      [this, self](error_code ec, std::size_t) {
                        if (ec) {
                          fail("echo write: " + ec.message());
                          return;
                        }
                        read_more();
                      });
  }

  tcp::socket sock_;
  Server &srv_;
  std::vector<char> buf_ = std::vector<char>(64 << 10);
};

class Server {
 public:
  explicit Server(asio::io_context &io) : io_(io), strand_(asio::make_strand(io)), acc_(strand_) {}

  bool open(unsigned short &bound) {
    error_code ec;
    tcp::endpoint ep(asio::ip::make_address(host, ec), 0);
    if (ec) return fail_open("address " + host + ": " + ec.message());
    acc_.open(ep.protocol(), ec);
    if (!ec) acc_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acc_.bind(ep, ec);
    if (!ec) acc_.listen(512, ec);
    if (ec) return fail_open("bind/listen " + host + ": " + ec.message());
    bound = acc_.local_endpoint().port();
    return true;
  }

  void accept() {
    acc_.async_accept(asio::make_strand(io_),
                      [this](error_code ec, tcp::socket s) {
                        if (ec == asio::error::operation_aborted) return;
                        if (ec) {
                          fail("accept: " + ec.message());
                        } else {
                          served++;
                          s.set_option(tcp::no_delay(true), ec);
                          std::make_shared<Session>(std::move(s), *this)->start();
                        }
                        if (acc_.is_open()) accept();
                      });
  }

  // Called from any thread: the acceptor belongs to its strand.
  void quit() {
    asio::post(strand_, [this] {
      error_code ec;
      acc_.close(ec);
    });
  }

 private:
  static bool fail_open(const std::string &why) {
    std::printf("FAIL server: %s\n", why.c_str());
    return false;
  }
  asio::io_context &io_;
  asio::strand<asio::io_context::executor_type> strand_;
  tcp::acceptor acc_;
};

void Session::read_cmd() {
  auto self = shared_from_this();
  sock_.async_read_some(asio::buffer(buf_), [this, self](error_code ec, std::size_t n) {
    if (ec) {
      fail("reading the command byte: " + ec.message());
      return;
    }
    char cmd = buf_[0];
    if (cmd == 'Q') {
      srv_.quit();
      return;  // the socket closes with the session
    }
    if (cmd != 'E') {
      fail("unknown command byte " + std::to_string(static_cast<unsigned char>(cmd)));
      return;
    }
    if (n > 1)
      write(1, n - 1);
    else
      read_more();
  });
}

int server() {
  asio::io_context io(nthreads);
  Server srv(io);
  unsigned short p = 0;
  if (!srv.open(p)) return 1;
  std::string tmp = port_file + ".tmp";
  {
    std::ofstream f(tmp);
    f << p << "\n";
    if (!f) {
      std::printf("FAIL server: cannot write %s\n", tmp.c_str());
      return 1;
    }
  }
  if (std::rename(tmp.c_str(), port_file.c_str()) != 0) {
    std::printf("FAIL server: cannot write %s\n", port_file.c_str());
    return 1;
  }
  srv.accept();
  run_threads(io);
  if (errors) {
    std::printf("FAIL server: %d error(s), first: %s\n", errors.load(), first_error.c_str());
    return 1;
  }
  std::printf("OK server conns=%ld bytes=%llu\n", served.load(), echoed.load());
  return 0;
}

// ---- client -------------------------------------------------------------------------------------

std::vector<char> pattern(int c, int k, std::size_t n) {
  std::vector<char> p(n);
  std::uint64_t x = 0x9e3779b97f4a7c15ULL ^ (static_cast<std::uint64_t>(c) << 32) ^
                    static_cast<std::uint64_t>(k + 1);
  for (std::size_t i = 0; i < n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    for (std::size_t j = 0; j < 8 && i + j < n; j++) p[i + j] = static_cast<char>(x >> (8 * j));
  }
  return p;
}

// One echo connection: each message is written while its reply is read; the reply must equal
// it; then a half-close, and the server's EOF must follow with nothing before it.
class Conn : public std::enable_shared_from_this<Conn> {
 public:
  Conn(asio::io_context &io, tcp::endpoint ep, int id, std::vector<int> sizes, char cmd)
      : sock_(asio::make_strand(io)), ep_(ep), id_(id), sizes_(std::move(sizes)), cmd_(cmd) {}

  void start() {
    auto self = shared_from_this();
    sock_.async_connect(ep_, [this, self](error_code ec) {
      if (ec) return bad("connect: " + ec.message());
      sock_.set_option(tcp::no_delay(true), ec);
      asio::async_write(sock_, asio::buffer(&cmd_, 1), [this, self](error_code e, std::size_t) {
        if (e) return bad("command byte: " + e.message());
        next();
      });
    });
  }

 private:
  void bad(const std::string &why) {
    fail("connection " + std::to_string(id_) + ": " + why);
    error_code ec;
    sock_.close(ec);
  }

  void next() {
    if (k_ == sizes_.size()) return finish();
    std::size_t n = static_cast<std::size_t>(sizes_[k_]);
    msg_ = pattern(id_, static_cast<int>(k_), n);
    got_.assign(n, 0);
    pending_ = 2;
    auto self = shared_from_this();
    asio::async_write(sock_, asio::buffer(msg_), [this, self](error_code ec, std::size_t) {
      if (ec) return bad("message " + std::to_string(k_) + ": write: " + ec.message());
      step();
    });
    asio::async_read(sock_, asio::buffer(got_), [this, self](error_code ec, std::size_t m) {
      if (ec)
        return bad("message " + std::to_string(k_) + ": read after " + std::to_string(m) +
                   " B: " + ec.message());
      step();
    });
  }

  void step() {
    if (--pending_ > 0) return;
    if (got_ != msg_) {
      std::size_t at = 0;
      while (got_[at] == msg_[at]) at++;
      return bad("message " + std::to_string(k_) + " (" + std::to_string(msg_.size()) +
                 " B): reply differs from byte " + std::to_string(at) + " on");
    }
    k_++;
    next();
  }

  void finish() {
    error_code ec;
    if (cmd_ == 'E') sock_.shutdown(tcp::socket::shutdown_send, ec);
    if (ec) return bad("shutdown: " + ec.message());
    auto self = shared_from_this();
    sock_.async_read_some(asio::buffer(tail_), [this, self](error_code e, std::size_t n) {
      if (e == asio::error::eof) return;
      if (e) return bad("waiting for EOF: " + e.message());
      bad(std::to_string(n) + " unexpected byte(s) after the last reply");
    });
  }

  tcp::socket sock_;
  tcp::endpoint ep_;
  int id_;
  std::vector<int> sizes_;
  char cmd_;
  std::size_t k_ = 0;
  int pending_ = 0;
  std::vector<char> msg_, got_;
  char tail_[64];
};

int client() {
  error_code ec;
  tcp::endpoint ep(asio::ip::make_address(host, ec), static_cast<unsigned short>(port));
  if (ec) {
    std::printf("FAIL client: address %s: %s\n", host.c_str(), ec.message().c_str());
    return 1;
  }
  std::vector<std::vector<int>> plan;
  if (test == "echo") {
    plan.push_back({1, 2, 7, 100, 1000, 1460, 4096, 65535, 65536, 100003, 262144, 1 << 20});
  } else if (test == "rr") {
    std::vector<int> s;
    for (int i = 0; i < count; i++) s.push_back(1 + (i * 7) % 64);
    plan.push_back(s);
  } else if (test == "many") {
    plan.assign(static_cast<std::size_t>(nconns), std::vector<int>{nbytes});
  } else {
    std::printf("FAIL client: unknown test %s\n", test.c_str());
    return 2;
  }
  {
    asio::io_context io(nthreads);
    for (std::size_t i = 0; i < plan.size(); i++)
      std::make_shared<Conn>(io, ep, static_cast<int>(i), plan[i], 'E')->start();
    run_threads(io);
  }
  {
    asio::io_context io(1);
    std::make_shared<Conn>(io, ep, -1, std::vector<int>{}, 'Q')->start();
    io.run();
  }
  if (errors) {
    std::printf("FAIL client %s: %d error(s), first: %s\n", test.c_str(), errors.load(),
                first_error.c_str());
    return 1;
  }
  std::printf("OK client %s\n", test.c_str());
  return 0;
}

}  // namespace

int main(int argc, char **argv) {
  if (argc < 2) {
    std::printf("FAIL usage: asio_echo server|client [options]\n");
    return 2;
  }
  std::string role = argv[1];
  for (int i = 2; i + 1 < argc; i += 2) {
    std::string f = argv[i], v = argv[i + 1];
    if (f == "--host") host = v;
    else if (f == "--port") port = std::atoi(v.c_str());
    else if (f == "--port-file") port_file = v;
    else if (f == "--test") test = v;
    else if (f == "--count") count = std::atoi(v.c_str());
    else if (f == "--conns") nconns = std::atoi(v.c_str());
    else if (f == "--bytes") nbytes = std::atoi(v.c_str());
    else if (f == "--deadline") deadline = std::atoi(v.c_str());
    else if (f == "--threads") nthreads = std::atoi(v.c_str());
    else {
      std::printf("FAIL unknown option %s\n", f.c_str());
      return 2;
    }
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::signal(SIGPIPE, SIG_IGN);
  std::signal(SIGALRM, on_alarm);
  alarm(static_cast<unsigned>(deadline));
  if (role == "server") {
    if (port_file.empty()) {
      std::printf("FAIL server: --port-file is required\n");
      return 2;
    }
    return server();
  }
  if (role == "client") return client();
  std::printf("FAIL unknown role %s\n", role.c_str());
  return 2;
}
