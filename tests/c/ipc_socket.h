/* A unix socket between the processes of one test program, as NCCL's
 * ncclIpcSocket uses one (src/os/linux_ipcsocket.cc @5067397 lines
 * 140-231): bytes, and a file descriptor sent with SCM_RIGHTS. Every call
 * exits 1 on failure (a test program has nothing to recover). Included as
 * "ipc_socket.h" from tests/c (ipc_pair.c, tp_serve.c). */
#ifndef VCUDA_TESTS_IPC_SOCKET_H
#define VCUDA_TESTS_IPC_SOCKET_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

static int listen_on(const char *path) {
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  int s = socket(AF_UNIX, SOCK_STREAM, 0);
  strncpy(a.sun_path, path, sizeof a.sun_path - 1);
  unlink(path);
  if (s < 0 || bind(s, (struct sockaddr *)&a, sizeof a) || listen(s, 1)) {
    perror("listen");
    exit(1);
  }
  int c = accept(s, NULL, NULL);
  close(s);
  return c;
}

static int connect_to(const char *path) {
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  strncpy(a.sun_path, path, sizeof a.sun_path - 1);
  for (int i = 0; i < 500; i++) {
    int s = socket(AF_UNIX, SOCK_STREAM, 0);
    if (connect(s, (struct sockaddr *)&a, sizeof a) == 0)
      return s;
    close(s);
    usleep(20000);
  }
  fprintf(stderr, "no server at %s\n", path);
  exit(1);
}

static void send_all(int s, const void *b, size_t n) {
  if (write(s, b, n) != (ssize_t)n) {
    perror("write");
    exit(1);
  }
}

static void recv_all(int s, void *b, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = read(s, (char *)b + got, n - got);
    if (r <= 0) {
      perror("read");
      exit(1);
    }
    got += r;
  }
}

static void send_fd(int s, int fd) {
  char byte = 'f', ctl[CMSG_SPACE(sizeof(int))] = {0};
  struct iovec iov = {&byte, 1};
  struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl, .msg_controllen = sizeof ctl};
  struct cmsghdr *c = CMSG_FIRSTHDR(&m);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(c), &fd, sizeof fd);
  if (sendmsg(s, &m, 0) != 1) {
    perror("sendmsg");
    exit(1);
  }
}

static int recv_fd(int s) {
  char byte, ctl[CMSG_SPACE(sizeof(int))];
  struct iovec iov = {&byte, 1};
  struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl, .msg_controllen = sizeof ctl};
  int fd = -1;
  if (recvmsg(s, &m, 0) != 1) {
    perror("recvmsg");
    exit(1);
  }
  struct cmsghdr *c = CMSG_FIRSTHDR(&m);
  if (!c || c->cmsg_type != SCM_RIGHTS) {
    fprintf(stderr, "no fd received\n");
    exit(1);
  }
  memcpy(&fd, CMSG_DATA(c), sizeof fd);
  return fd;
}

#endif
