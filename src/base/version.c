/*
 * version.c - runtime version queries, so a program can check which libkvtier
 * it loaded against the KVT_VERSION_* macros it was compiled with.
 */
#include "kvtier.h"

const char *kvt_version(void) {
  return KVT_VERSION_STRING;
}
int kvt_version_number(void) {
  return KVT_VERSION_NUMBER;
}
