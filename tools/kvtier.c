/*
 * kvtier.c - entry point of the `kvtier` command-line tool: global options
 * (--help, --version) and dispatch to the commands (ls, stats, show, verify,
 * gc, reindex, bench). Each command parses its own options and prints its own
 * --help; exit codes are shared and listed in the global help and docs/CLI.md.
 */
#include "cli.h"

#include <string.h>

static const char *USAGE =
    "usage: kvtier COMMAND [OPTIONS] ...\n"
    "\n"
    "Inspect, verify, repair and benchmark a kvtier cache directory (a cold\n"
    "KV-cache tier on local SSD; directories written by the vllm-mlx\n"
    "reference work too).\n"
    "\n"
    "Commands:\n"
    "  ls DIR            list entries (hash, tokens, layers, dtypes, sizes, "
    "times,\n"
    "                    chains)\n"
    "  stats DIR         totals, capacity, live counters; --watch, "
    "--prometheus\n"
    "  show DIR HASH     one entry: manifest, layers, tensors and shapes\n"
    "  verify DIR        check every entry and the index; --repair fixes\n"
    "  gc DIR            apply size/count/age limits now, clean chunks/; "
    "--dry-run\n"
    "  reindex DIR       rebuild the index from the entry directories\n"
    "  bench [DIR]       spill and promote a synthetic workload, compare to "
    "disk\n"
    "                    (--preset chat: the chunked store's chat workload)\n"
    "\n"
    "Every command accepts --json (machine-readable output on stdout),\n"
    "--verbose (library log lines on stderr) and --help. ls, stats, show and\n"
    "verify open the directory read-only and change nothing.\n"
    "\n"
    "Exit codes:\n"
    "  0  success (verify: everything is good)\n"
    "  1  verify found problems (also when --repair fixed them)\n"
    "  2  usage error\n"
    "  3  directory missing, unreadable or not a kvtier cache\n"
    "  4  the operation failed (I/O or database error, repair failed, ...)\n"
    "  5  show: no such entry\n"
    "  130  bench interrupted (its directory or entries are removed first)\n"
    "\n"
    "Options:\n"
    "  -h, --help        this help;  kvtier COMMAND --help for a command\n"
    "  -V, --version     print the tool and library versions\n"
    "\n"
    "Quick start:  kvtier bench --quick\n";

static const struct {
  const char *name;
  int (*fn)(int, char **);
} CMDS[] = {{"ls", cmd_ls},      {"stats", cmd_stats},
            {"show", cmd_show},  {"verify", cmd_verify},
            {"gc", cmd_gc},      {"reindex", cmd_reindex},
            {"bench", cmd_bench}};

static int run(const char *cmd, int argc, char **argv) {
  for (size_t i = 0; i < sizeof CMDS / sizeof CMDS[0]; i++)
    if (strcmp(cmd, CMDS[i].name) == 0)
      return CMDS[i].fn(argc, argv);
  fprintf(stderr, "kvtier: unknown command '%s' (see kvtier --help)\n", cmd);
  return CLI_USAGE;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fputs(USAGE, stderr);
    return CLI_USAGE;
  }
  const char *cmd = argv[1];
  if (strcmp(cmd, "help") == 0 && argc > 2) {
    /* "kvtier help ls" is "kvtier ls --help". */
    char help[] = "--help";
    char *hv[] = {help, NULL};
    return run(argv[2], 1, hv);
  }
  if (strcmp(cmd, "-h") == 0 || strcmp(cmd, "--help") == 0 ||
      strcmp(cmd, "help") == 0) {
    fputs(USAGE, stdout);
    return CLI_OK;
  }
  if (strcmp(cmd, "-V") == 0 || strcmp(cmd, "--version") == 0 ||
      strcmp(cmd, "version") == 0) {
    printf("kvtier %s (library %s)\n", KVT_VERSION_STRING, kvt_version());
    return CLI_OK;
  }
  return run(cmd, argc - 2, argv + 2);
}
