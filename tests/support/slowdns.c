/* A test shim, loaded with LD_PRELOAD: a host name whose resolution hangs.
 *
 * getaddrinfo() for the name in KVS_SLOW_DNS_HOST sleeps KVS_SLOW_DNS_S seconds and then
 * fails with EAI_AGAIN, as a resolver whose server does not answer does; every other
 * name resolves as usual. Name resolution has no timeout of its own (httpx's connect
 * timeout starts after it), so this is what an unreachable DNS server does to a caller. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netdb.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int (*getaddrinfo_fn)(const char *, const char *, const struct addrinfo *,
                              struct addrinfo **);

int
getaddrinfo(const char *node, const char *service, const struct addrinfo *hints,
            struct addrinfo **res)
{
    static getaddrinfo_fn real;
    if (real == NULL)
        real = (getaddrinfo_fn)dlsym(RTLD_NEXT, "getaddrinfo");
    const char *slow = getenv("KVS_SLOW_DNS_HOST");
    if (node != NULL && slow != NULL && strcmp(node, slow) == 0) {
        const char *delay = getenv("KVS_SLOW_DNS_S");
        double s = delay != NULL ? strtod(delay, NULL) : 5.0;
        struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
        while (nanosleep(&ts, &ts) != 0) /* the rest of the time after a signal */
            ;
        return EAI_AGAIN;
    }
    return real(node, service, hints, res);
}
