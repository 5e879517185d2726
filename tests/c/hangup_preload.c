/* LD_PRELOAD for tests/shim_entry.rs: makes "the manager hung up before the
 * request was written" deterministic. connect() to a socket named
 * vcuda.sock returns only once the peer has closed the connection (or after
 * 2 s), so the interposer's registration write always meets a dead peer:
 * EPIPE, and SIGPIPE unless the write says MSG_NOSIGNAL.
 * Build: gcc -shared -fPIC -o hangup_preload.so hangup_preload.c -ldl */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>

int connect(int fd, const struct sockaddr *addr, socklen_t len) {
  static int (*real)(int, const struct sockaddr *, socklen_t);
  if (!real) real = (int (*)(int, const struct sockaddr *, socklen_t))dlsym(RTLD_NEXT, "connect");
  int r = real(fd, addr, len);
  if (r == 0 && addr->sa_family == AF_UNIX) {
    const char *path = ((const struct sockaddr_un *)addr)->sun_path;
    size_t n = strlen(path);
    if (n >= 10 && strcmp(path + n - 10, "vcuda.sock") == 0) {
      struct pollfd p = {fd, POLLRDHUP, 0};
      poll(&p, 1, 2000);
    }
  }
  return r;
}
