/*
 * cmd_bench_chat.c - `kvtier bench --preset chat`: the chunked native store's
 * chat workload (bench/benchchat.h, shared with bench/bench_chunked) run in
 * one go under DIR (or a fresh scratch directory) and reported as text or
 * JSON: bytes written per new token and disk / unique KV for an aligned and
 * an unaligned multi-turn chat, tokens served per prefix query, and the
 * durable spill / cold promote of 256-token Llama-3-8B entries next to fio's
 * O_DIRECT write / read measured in the same rounds (the fio jobs printed).
 * With --keep the chat caches stay in DIR/chat-* (chunked caches to inspect
 * with ls/show/stats).
 */
#define _GNU_SOURCE
#include "benchchat.h"
#include "cli.h"
#include "cmd_bench.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static void chat_step(void *ctx, const char *msg) {
  if (*(int *)ctx)
    fprintf(stderr, "kvtier bench: %s...\n", msg);
}

static void mt_json(cJSON *o, const char *name, const bu_chat_mt *m) {
  cJSON *j = cJSON_AddObjectToObject(o, name);
  cJSON_AddNumberToObject(j, "turns", m->turns);
  cJSON_AddNumberToObject(j, "tokens", (double)m->tokens);
  cJSON_AddNumberToObject(j, "bytes_written", (double)m->written);
  cJSON_AddNumberToObject(j, "disk_bytes", (double)m->disk);
  cJSON_AddNumberToObject(j, "bytes_written_per_new_token", m->per_token);
  cJSON_AddNumberToObject(j, "written_per_unique", m->written_per_unique);
  cJSON_AddNumberToObject(j, "disk_per_unique", m->disk_per_unique);
}

int cli_bench_chat(cli_flag *f, size_t nf, const char *given) {
  int json = cli_flag_get(f, nf, "json")->set;
  int quick = cli_flag_get(f, nf, "quick")->set;
  int keep = cli_flag_get(f, nf, "keep")->set;
  int progress =
      !cli_flag_get(f, nf, "no-progress")->set && !json && cli_isatty_err();
  static const char *other[] = {"tokens",     "dtype",     "storage",
                                "durability", "disk-size", "cold"};
  for (size_t i = 0; i < sizeof other / sizeof other[0]; i++)
    if (cli_flag_get(f, nf, other[i])->set)
      return cli_fail(json, "bench", CLI_USAGE,
                      "--%s does not apply to --preset chat", other[i]);
  bu_chat_opts o;
  memset(&o, 0, sizeof o);
  o.layers = quick ? 2 : 8;
  o.turns = quick ? 8 : 20;
  o.aligned_turns = quick ? 4 : 8;
  o.convs = quick ? 4 : 16;
  o.entries = quick ? 2 : 4;
  o.rounds = quick ? 1 : 5;
  o.burst = quick ? 4 : 16; /* queued at once: the group commit's figure */
  o.fio = !cli_flag_get(f, nf, "no-disk")->set;
  o.seed = 1;
  o.keep = keep;
  o.step = chat_step;
  o.step_ctx = &progress;
  uint64_t u;
  const char *v;
  if ((v = cli_flag_get(f, nf, "rounds")->value)) {
    if (cli_parse_u64(v, &u) != 0 || u < 1 || u > 16)
      return cli_fail(json, "bench", CLI_USAGE,
                      "--rounds needs 1..16, got '%s'", v);
    o.rounds = (int)u;
  }
  if ((v = cli_flag_get(f, nf, "entries")->value)) {
    if (cli_parse_u64(v, &u) != 0 || u < 1 || u > 64)
      return cli_fail(json, "bench", CLI_USAGE,
                      "--entries needs 1..64 with --preset chat, got '%s'", v);
    o.entries = (int)u;
  }
  if ((v = cli_flag_get(f, nf, "seed")->value) &&
      cli_parse_u64(v, &o.seed) != 0)
    return cli_fail(json, "bench", CLI_USAGE, "--seed needs a number");
  if ((v = cli_flag_get(f, nf, "chunk-tokens")->value)) {
    if (cli_parse_u64(v, &u) != 0 || u < 16 || u > 4096 || (u & (u - 1)))
      return cli_fail(json, "bench", CLI_USAGE,
                      "--chunk-tokens needs a power of two in 16..4096 with "
                      "--preset chat, got '%s'",
                      v);
    o.chunk_tokens = (uint32_t)u;
  }
  /* The scratch directory: DIR (created if missing; the chat caches go in
   * DIR/chat-*), else a fresh one removed afterwards. */
  char dir[4096];
  int made = 0;
  if (given) {
    snprintf(dir, sizeof dir, "%s", given);
    struct stat st;
    if (stat(dir, &st) != 0) {
      if (errno != ENOENT || mkdir(dir, 0700) != 0)
        return cli_fail(json, "bench", CLI_NOOPEN, "%s: cannot create: %s", dir,
                        strerror(errno));
      made = 1;
    } else if (!S_ISDIR(st.st_mode)) {
      return cli_fail(json, "bench", CLI_NOOPEN, "%s: not a directory", dir);
    }
  } else {
    const char *tmp = getenv("TMPDIR");
    snprintf(dir, sizeof dir, "%s/kvtier-chat-XXXXXX",
             tmp && *tmp ? tmp : "/var/tmp");
    if (!mkdtemp(dir))
      return cli_fail(json, "bench", CLI_NOOPEN, "cannot create %s: %s", dir,
                      strerror(errno));
    made = 1;
  }
  o.dir = dir;
  bu_chat_result r;
  int rc = bu_chat_run(&r, &o);
  if (made && !keep)
    cli_rmtree(dir);
  if (rc != 0)
    return cli_fail(json, "bench", CLI_FAILED, "chat workload: %s", r.error);
  if (!json) {
    printf("kvtier bench %s: preset chat (the chunked native store)\n",
           KVT_VERSION_STRING);
    bu_chat_print(&r, stdout);
    if (keep)
      printf("kept: %s/chat-aligned, chat-unaligned, chat-prefix\n", dir);
    return CLI_OK;
  }
  cJSON *j = cJSON_CreateObject();
  cJSON_AddStringToObject(j, "version", KVT_VERSION_STRING);
  cJSON_AddStringToObject(j, "preset", "chat");
  cJSON_AddNumberToObject(j, "chunk_tokens", r.chunk_tokens);
  cJSON_AddNumberToObject(j, "layers", r.layers);
  cJSON_AddNumberToObject(j, "kv_bytes_per_token", (double)r.kv_per_token);
  mt_json(j, "aligned", &r.aligned);
  mt_json(j, "unaligned", &r.unaligned);
  cJSON *p = cJSON_AddObjectToObject(j, "prefix_query");
  cJSON_AddNumberToObject(p, "query_tokens", (double)r.prefix_query_tokens);
  cJSON_AddNumberToObject(p, "served_tokens", (double)r.prefix_served);
  cJSON_AddBoolToObject(p, "bit_exact", r.prefix_exact > 0);
  cJSON_AddNumberToObject(p, "shared_prompt_disk_per_unique",
                          r.shared_disk_per_unique);
  cJSON *s = cJSON_AddObjectToObject(j, "spill_promote");
  cJSON_AddNumberToObject(s, "rounds", r.spill_rounds);
  cJSON_AddNumberToObject(s, "entry_bytes", (double)r.spill_entry_bytes);
  cJSON_AddNumberToObject(s, "spill_bytes_per_second", r.spill_bps);
  cJSON_AddNumberToObject(s, "promote_cold_bytes_per_second", r.promote_bps);
  cJSON_AddBoolToObject(s, "promote_bit_exact", r.promote_exact);
  cJSON *pc = cJSON_AddObjectToObject(s, "page_cache");
  cJSON_AddNumberToObject(pc, "files", (double)r.cold_res.files);
  cJSON_AddNumberToObject(pc, "pages", (double)r.cold_res.pages);
  cJSON_AddNumberToObject(pc, "resident_before_eviction",
                          r.cold_res.pages ? (double)r.cold_res.before /
                                                 (double)r.cold_res.pages
                                           : 0);
  cJSON_AddNumberToObject(pc, "resident_at_read", r.promote_resident);
  cJSON_AddNumberToObject(pc, "resident_max", BU_COLD_RESIDENT_MAX);
  cJSON_AddBoolToObject(s, "spill_flagged", r.spill_flags != 0);
  cJSON_AddNumberToObject(s, "spill_flagged_rounds", r.spill_flagged_rounds);
  if (r.spill_flags)
    cJSON_AddStringToObject(s, "spill_flag",
                            bu_figure_flag_text(r.spill_flags));
  cJSON_AddBoolToObject(s, "promote_flagged", r.promote_flags != 0);
  cJSON_AddNumberToObject(s, "promote_flagged_rounds",
                          r.promote_flagged_rounds);
  if (r.promote_flags)
    cJSON_AddStringToObject(s, "promote_flag",
                            bu_figure_flag_text(r.promote_flags));
  cJSON *b = cJSON_AddObjectToObject(s, "burst");
  cJSON_AddNumberToObject(b, "spills", r.burst);
  cJSON_AddNumberToObject(b, "bytes_per_second", r.burst_bps);
  cJSON_AddNumberToObject(b, "group_committed", (double)r.burst_batched);
  cJSON_AddBoolToObject(b, "flagged", r.burst_flags != 0);
  if (r.have_fio && r.burst > 0) {
    cJSON_AddNumberToObject(b, "fio_files_fsync_each_bps", r.fio_burst_bps);
    cJSON_AddNumberToObject(b, "ratio", r.burst_ratio);
    cJSON_AddNumberToObject(b, "ratio_min", r.burst_ratio_min);
    cJSON_AddNumberToObject(b, "ratio_max", r.burst_ratio_max);
    cJSON_AddStringToObject(b, "fio_job", r.fio_burst_job);
    cJSON_AddNumberToObject(b, "fio_one_job_bps", r.fio_burst_seq_bps);
    cJSON_AddStringToObject(b, "fio_one_job", r.fio_burst_seq_job);
  } else {
    cJSON_AddNullToObject(b, "ratio");
  }
  if (r.have_fio) {
    cJSON_AddNumberToObject(s, "fio_write_direct_bps", r.fio_write_bps);
    cJSON_AddNumberToObject(s, "fio_read_direct_bps", r.fio_read_bps);
    cJSON_AddNumberToObject(s, "spill_ratio", r.spill_ratio);
    cJSON_AddNumberToObject(s, "spill_ratio_min", r.spill_ratio_min);
    cJSON_AddNumberToObject(s, "spill_ratio_max", r.spill_ratio_max);
    cJSON_AddNumberToObject(s, "promote_ratio", r.promote_ratio);
    cJSON_AddStringToObject(s, "fio_write_job", r.fio_write_job);
    cJSON_AddStringToObject(s, "fio_read_job", r.fio_read_job);
    cJSON_AddStringToObject(s, "fio_write_timed", BU_CHAT_FIO_WRITE_TIMED);
    cJSON_AddStringToObject(s, "spill_timed", BU_CHAT_SPILL_TIMED);
  } else {
    cJSON_AddNullToObject(s, "spill_ratio");
    cJSON_AddNullToObject(s, "promote_ratio");
  }
  cJSON_AddBoolToObject(j, "kept", keep);
  cli_json_print(j);
  return CLI_OK;
}
