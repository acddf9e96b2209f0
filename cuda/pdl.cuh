// pdl.cuh: programmatic dependent launch (sm_90). Every kernel's first statement is PDL_ENTRY():
//   griddepcontrol.wait              blocks until every grid this one depends on has completed
//                                    and its memory writes are visible (a no-op for a launch
//                                    without the programmatic-serialization attribute);
//   griddepcontrol.launch_dependents lets the next kernel in the stream (or graph) be launched
//                                    now: its blocks are scheduled onto the SMs while this grid
//                                    runs and wait in their own PDL_ENTRY.
// Nothing global is read or written before the wait and no block returns before it, so a grid
// completes only after its predecessor did (the chain stays ordered transitively). The trigger
// comes after the wait, so at most one dependent grid is resident ahead of its turn.
// No launch geometry of its own; see the kernel files.
#pragma once

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_ENTRY()                                                                         \
    do {                                                                                    \
        asm volatile("griddepcontrol.wait;" ::: "memory");                                 \
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");                    \
    } while (0)
#else
#define PDL_ENTRY() do {} while (0)
#endif
