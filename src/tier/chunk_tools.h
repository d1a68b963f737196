/*
 * chunk_tools.h - the tools' side of the chunked native store inside the tier
 * (chunk_tools.c implements kvt_tier_chunk_foreach, kvt_tier_entry_chain,
 * kvt_tier_chunk_totals, kvt_tier_chunk_verify and kvt_tier_chunk_gc of
 * include/kvtier_sys.h) and the writer's lazy orphan sweep declared here.
 */
#ifndef KVT_TIER_CHUNK_TOOLS_H
#define KVT_TIER_CHUNK_TOOLS_H

#include "tier/tier.h"

/* After a chunked spill (writer, mut_mu held): on the first call and every
 * KVTI_CHUNK_SWEEP_EVERY calls after it, one bounded pass: one subdirectory
 * of chunks/ cleaned as kvt_tier_chunk_gc does (stale *.tmp removed, orphans
 * adopted or removed) and up to KVTI_CHUNK_SWEEP_ENTRIES chained-entry
 * records checked (those whose entry has neither row nor files removed).
 * The pass resumes where the last one stopped, in this process or an
 * earlier one (chunks/sweep.pos), so crash leftovers go however short-lived
 * the writers are, without open ever listing chunks/. Errors are logged,
 * never returned (the spill succeeded). */
#define KVTI_CHUNK_SWEEP_EVERY 64u
#define KVTI_CHUNK_SWEEP_ENTRIES 256u
void kvti_tier_chunks_sweep_lazy(kvt_tier *t);

#endif
