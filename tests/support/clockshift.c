/* A test shim, loaded with LD_PRELOAD: steps the wall clock of the process it is loaded in.
 *
 * CLOCK_REALTIME (clock_gettime, gettimeofday, time) reads the real clock plus the seconds
 * written in the file named by KVS_CLOCKSHIFT_FILE, read at every call, so a test moves a
 * running process's wall clock as NTP or a resumed VM would, without touching the
 * machine's. The monotonic clocks are left as they are. No file, or no number in it: no
 * shift. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

typedef int (*clock_gettime_fn)(clockid_t, struct timespec *);

static double
shift_s(void)
{
    const char *path = getenv("KVS_CLOCKSHIFT_FILE");
    if (path == NULL)
        return 0.0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0.0;
    char buf[64];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0.0;
    buf[n] = '\0';
    return strtod(buf, NULL);
}

static int
real_clock_gettime(clockid_t id, struct timespec *ts)
{
    static clock_gettime_fn real;
    if (real == NULL)
        real = (clock_gettime_fn)dlsym(RTLD_NEXT, "clock_gettime");
    return real(id, ts);
}

static void
shift(struct timespec *ts)
{
    double s = shift_s();
    if (s == 0.0)
        return;
    long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + (long long)(s * 1e9);
    ts->tv_sec = (time_t)(ns / 1000000000LL);
    ts->tv_nsec = (long)(ns % 1000000000LL);
}

int
clock_gettime(clockid_t id, struct timespec *ts)
{
    int rc = real_clock_gettime(id, ts);
    if (rc == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE))
        shift(ts);
    return rc;
}

int
gettimeofday(struct timeval *tv, void *tz)
{
    (void)tz;
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0)
        return -1;
    if (tv != NULL) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return 0;
}

time_t
time(time_t *out)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0)
        return (time_t)-1;
    if (out != NULL)
        *out = ts.tv_sec;
    return ts.tv_sec;
}
