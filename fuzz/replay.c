/*
 * replay.c - the replay driver of a fuzz target: a main() that feeds every file
 * of the given directories (or the given files) to LLVMFuzzerTestOneInput, in
 * name order, once each. It builds with gcc or clang without libFuzzer, so
 * every build (plain, ASan/UBSan, TSan) replays the committed seed corpus and
 * any crash reproducer through the same code the fuzzer runs. Exit status: 0
 * when all inputs ran, 1 when a directory was empty or unreadable (a missing
 * corpus must not pass silently); a finding aborts.
 */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int run_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    perror(path);
    return -1;
  }
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  /* An exact-size heap copy, so ASan sees reads past the end of the input. */
  uint8_t *b = malloc(n > 0 ? (size_t)n : 1);
  if (n > 0 && fread(b, 1, (size_t)n, f) != (size_t)n) {
    fclose(f);
    free(b);
    return -1;
  }
  fclose(f);
  LLVMFuzzerTestOneInput(b, (size_t)n);
  free(b);
  return 0;
}

static int cmp(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

int main(int argc, char **argv) {
  long total = 0;
  for (int i = 1; i < argc; i++) {
    struct stat st;
    if (stat(argv[i], &st) != 0) {
      perror(argv[i]);
      return 1;
    }
    if (!S_ISDIR(st.st_mode)) {
      if (run_file(argv[i]) != 0)
        return 1;
      total++;
      continue;
    }
    DIR *d = opendir(argv[i]);
    if (!d) {
      perror(argv[i]);
      return 1;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
      if (de->d_name[0] == '.')
        continue;
      if (n == cap) {
        cap = cap ? 2 * cap : 64;
        names = realloc(names, cap * sizeof *names);
      }
      size_t l = strlen(argv[i]) + strlen(de->d_name) + 2;
      names[n] = malloc(l);
      snprintf(names[n], l, "%s/%s", argv[i], de->d_name);
      n++;
    }
    closedir(d);
    qsort(names, n, sizeof *names, cmp);
    for (size_t k = 0; k < n; k++) {
      if (run_file(names[k]) != 0)
        return 1;
      free(names[k]);
    }
    free(names);
    if (n == 0) {
      fprintf(stderr, "%s: no inputs\n", argv[i]);
      return 1;
    }
    total += (long)n;
  }
  printf("replayed %ld inputs\n", total);
  return 0;
}
