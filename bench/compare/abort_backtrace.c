/* A SIGABRT handler preloaded into a process that aborts at exit with no Python frame to
   show (std::terminate in a C++ destructor): it prints the aborting thread's native stack
   (exported symbols) and every thread's name, then aborts as before. Run 70 found so why
   reduce_kernel_probe.py aborted at exit (the watchdog freeing a call while the interpreter
   finalized). The device machine has no gdb.
     gcc -shared -fPIC -O1 -o /tmp/abort_backtrace.so bench/compare/abort_backtrace.c
     LD_PRELOAD=/tmp/abort_backtrace.so python3 SCRIPT.py  */
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>
#include <stdio.h>
#include <dirent.h>
#include <stdlib.h>
static void on_abrt(int sig) {
  void *frames[64];
  int n = backtrace(frames, 64);
  const char m[] = "\n=== SIGABRT backtrace (aborting thread) ===\n";
  write(2, m, sizeof m - 1);
  backtrace_symbols_fd(frames, n, 2);
  char buf[256];
  int l = snprintf(buf, sizeof buf, "=== tid %ld ===\n", (long)gettid());
  write(2, buf, l);
  /* the other threads' names */
  DIR *d = opendir("/proc/self/task");
  struct dirent *e;
  while (d && (e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    char p[300], name[64] = {0};
    snprintf(p, sizeof p, "/proc/self/task/%s/comm", e->d_name);
    FILE *f = fopen(p, "r");
    if (f) { fgets(name, sizeof name, f); fclose(f); }
    l = snprintf(buf, sizeof buf, "task %s %s", e->d_name, name);
    write(2, buf, l);
  }
  if (d) closedir(d);
  signal(SIGABRT, SIG_DFL);
  raise(SIGABRT);
}
__attribute__((constructor)) static void init(void) { signal(SIGABRT, on_abrt); }
