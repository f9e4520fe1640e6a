// omp_compat.h - OpenMP pragmas that vanish (without unknown-pragma warnings) when OpenMP is off.
#ifndef FLASH_STAGES_OMP_COMPAT_H
#define FLASH_STAGES_OMP_COMPAT_H

#ifdef _OPENMP
#include <omp.h>
#define OMP_PARALLEL _Pragma("omp parallel")
#define OMP_FOR_DYNAMIC _Pragma("omp for schedule(dynamic, 4)")
#define OMP_PARALLEL_FOR _Pragma("omp parallel for schedule(static)")
#define OMP_CRITICAL _Pragma("omp critical")
#define OMP_PRAGMA(text) _Pragma(#text)
// A parallel region where `condition` holds; otherwise the calling thread alone runs it (and a
// parallel region inside it may then use every thread).
#define OMP_PARALLEL_IF(condition) OMP_PRAGMA(omp parallel if(condition))
#else
#define OMP_PARALLEL
#define OMP_FOR_DYNAMIC
#define OMP_PARALLEL_FOR
#define OMP_CRITICAL
#define OMP_PARALLEL_IF(condition)
#endif

// The threads a parallel region would start here (1 without OpenMP).
static inline int omp_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

#endif
