/* The stream client's hot path, compiled: the reactor's read of every ready connection (drain,
 * tasks.wire.reactor.Reactor.read_ready) and the usual chunks of a read handed on as their
 * events (sse_chunks, below; tasks.wire.h1.Response.data_received).
 *
 * Per ready socket the Python reading costs a method per read (the transport's, then the stamped
 * socket's), the ancillary list recvmsg_into builds, its unpacking and a slice copy of the bytes:
 * ~2 us of a read's ~8 us (README "The read compiled"). This does the same in one call per loop
 * turn: epoll_wait with no wait on the reactor's epoll (man 7 epoll), one recvmsg per ready socket
 * into one buffer, its SO_TIMESTAMPNS kernel receive stamp (man 7 socket; the Python path:
 * tasks.wire.rxclock.StampedSocket.recv_into), the read's return on CLOCK_MONOTONIC (what
 * time.perf_counter_ns reads on Linux), and then exactly what the Python path does:
 *
 *   bytes read:  sock.read_ns = <return>; sock.rx_ns = <stamp> (when one came; sock may be None:
 *                no stamped socket); protocol.data_received(<the bytes>)
 *   end of file: transport._closed_by_read(None)
 *   an error:    transport._closed_by_read(OSError(errno, strerror)) (EAGAIN / EINTR: skipped)
 *
 * drain(epfd: int, handlers: dict[int, tuple[sock | None, protocol, transport]]) -> None; a ready
 * descriptor missing from handlers is skipped; an exception of a callback propagates at once (as
 * from the Python loop). Called with the GIL held throughout (a read that does not block), so the
 * one static buffer is never shared. Linux only (epoll, SO_TIMESTAMPNS); elsewhere the module is
 * not built and the Python path runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>

#define READ_BYTES (256 * 1024) /* as tasks.wire.reactor.READ_BYTES */
#define MAX_EVENTS 1024

static char buffer[READ_BYTES];
static PyObject *name_read_ns, *name_rx_ns, *name_data_received, *name_closed_by_read;

/* The read's kernel stamp (CLOCK_REALTIME ns) from its ancillary data; 0: none came. */
static long long kernel_stamp(struct msghdr *msg) {
    long long stamp = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c != NULL; c = CMSG_NXTHDR(msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_TIMESTAMPNS &&
            c->cmsg_len >= CMSG_LEN(sizeof(struct timespec))) {
            struct timespec ts;
            memcpy(&ts, CMSG_DATA(c), sizeof ts);
            stamp = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
        }
    }
    return stamp;
}

static int set_ns(PyObject *sock, PyObject *name, long long ns) {
    PyObject *value = PyLong_FromLongLong(ns);
    if (value == NULL)
        return -1;
    int failed = PyObject_SetAttr(sock, name, value);
    Py_DECREF(value);
    return failed;
}

/* One ready socket read and handed on; -1 with an exception set when a callback raised. */
static int read_one(int fd, PyObject *entry) {
    PyObject *sock = PyTuple_GET_ITEM(entry, 0), *protocol = PyTuple_GET_ITEM(entry, 1),
             *transport = PyTuple_GET_ITEM(entry, 2);
    union {
        char bytes[CMSG_SPACE(sizeof(struct timespec)) * 2];
        struct cmsghdr align;
    } control;
    struct iovec iov = {buffer, READ_BYTES};
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.bytes;
    msg.msg_controllen = sizeof control.bytes;
    ssize_t count = recvmsg(fd, &msg, 0);
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    PyObject *result;
    if (count > 0) {
        if (sock != Py_None) {
            long long stamp = kernel_stamp(&msg);
            if (set_ns(sock, name_read_ns, (long long)now.tv_sec * 1000000000LL + now.tv_nsec) < 0 ||
                (stamp && set_ns(sock, name_rx_ns, stamp) < 0))
                return -1;
        }
        PyObject *data = PyBytes_FromStringAndSize(buffer, count);
        if (data == NULL)
            return -1;
        result = PyObject_CallMethodOneArg(protocol, name_data_received, data);
        Py_DECREF(data);
    } else if (count == 0) {
        result = PyObject_CallMethodOneArg(transport, name_closed_by_read, Py_None);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
        return 0;
    } else {
        PyObject *error = PyObject_CallFunction(PyExc_OSError, "is", errno, strerror(errno));
        if (error == NULL)
            return -1;
        result = PyObject_CallMethodOneArg(transport, name_closed_by_read, error);
        Py_DECREF(error);
    }
    if (result == NULL)
        return -1;
    Py_DECREF(result);
    return 0;
}

/* One pass: every connection ready now read once; -1 with an exception set. */
static int read_ready_once(int epfd, PyObject *handlers) {
    struct epoll_event events[MAX_EVENTS];
    int ready = epoll_wait(epfd, events, MAX_EVENTS, 0);
    if (ready < 0) {
        if (errno == EINTR)
            return 0;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    for (int i = 0; i < ready; i++) {
        PyObject *key = PyLong_FromLong(events[i].data.fd);
        if (key == NULL)
            return -1;
        PyObject *entry = PyDict_GetItemWithError(handlers, key); /* borrowed */
        Py_DECREF(key);
        if (entry == NULL) {
            if (PyErr_Occurred())
                return -1;
            continue; /* closed during this turn */
        }
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 3) {
            PyErr_SetString(PyExc_TypeError, "a handler is (sock, protocol, transport)");
            return -1;
        }
        Py_INCREF(entry); /* a callback may remove it from handlers */
        int failed = read_one(events[i].data.fd, entry);
        Py_DECREF(entry);
        if (failed)
            return -1;
    }
    return 0;
}

static long long monotonic_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
}

/* drain(epfd, handlers, loop_epfd=-1, ready=None, deadline_ns=0): one pass (read_ready_once);
 * then, given the event loop's own epoll (loop_epfd, where epfd is one of its readers), the
 * loop's queue of ready callbacks (ready) and an instant on CLOCK_MONOTONIC (deadline_ns: the
 * loop's next timer, or a bound), it waits in the loop's epoll as the loop would, and while what
 * becomes ready there is only epfd it reads again here: the same reads, as soon as their bytes
 * come, without the loop's turn for each (README "Waiting in the reactor"). It returns to the
 * loop as soon as anything else is ready (another reader: the lag probe's pipe, a signal's
 * wake-up, a TLS socket), a callback was queued (ready not empty: a response ended), the
 * deadline passed or a signal's handler is due. The GIL is released while it waits. */
static PyObject *drain(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if ((nargs != 2 && nargs != 5) || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "drain(epfd, handlers[, loop_epfd, ready, deadline_ns])");
        return NULL;
    }
    int epfd = (int)PyLong_AsLong(args[0]);
    if (epfd == -1 && PyErr_Occurred())
        return NULL;
    if (read_ready_once(epfd, args[1]) < 0)
        return NULL;
    if (nargs == 2)
        Py_RETURN_NONE;
    int loop_epfd = (int)PyLong_AsLong(args[2]);
    long long deadline_ns = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *ready = args[3];
    while (loop_epfd >= 0) {
        Py_ssize_t queued = PyObject_Length(ready);
        if (queued != 0) {
            if (queued < 0)
                return NULL;
            break;
        }
        long long left_ns = deadline_ns - monotonic_ns();
        if (left_ns <= 0)
            break;
        struct timespec timeout = {left_ns / 1000000000LL, left_ns % 1000000000LL};
        struct epoll_event events[8];
        int count;
        Py_BEGIN_ALLOW_THREADS
        count = epoll_pwait2(loop_epfd, events, 8, &timeout, NULL);
        Py_END_ALLOW_THREADS
        if (count <= 0)
            break; /* the deadline, or interrupted: the loop's turn */
        int only_ours = 1;
        for (int i = 0; i < count; i++)
            if (events[i].data.fd != epfd)
                only_ours = 0;
        if (!only_ours)
            break;
        if (PyErr_CheckSignals() < 0 || read_ready_once(epfd, args[1]) < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

/* sse_chunks(data: bytes, on_event, read_ns: int, rx_ns: int | None) -> (consumed, data_bytes):
 * the leading whole HTTP/1.1 chunks of a read (RFC 9112 §7.1: a size in hex digits, CRLF, the
 * data, CRLF) whose data is each exactly one server-sent event of one data line ("data: " + a
 * payload without a line feed + "\n\n", the line not ended by "\r": WHATWG HTML, "Server-sent
 * events"), each payload handed to on_event(payload, read_ns, rx_ns) in order; it stops at the
 * first chunk that is not whole or not such an event (a size with anything but hex digits, an
 * extension, the last chunk, two lines, a part), which the Python framing then reads. Returns the
 * bytes it consumed and the data bytes of those chunks. What each chunk is handed on as is what
 * tasks.wire.h1.Response and tasks.wire.sse.SSEFramer.sink hand on for it (tested both ways);
 * an exception of on_event propagates at once. */
static int hex_value(char c) {
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

static PyObject *sse_chunks(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "sse_chunks(data: bytes, on_event, read_ns, rx_ns)");
        return NULL;
    }
    const char *p = PyBytes_AS_STRING(args[0]);
    Py_ssize_t n = PyBytes_GET_SIZE(args[0]), pos = 0, total = 0;
    PyObject *call[4] = {NULL, NULL, args[2], args[3]}; /* call[0]: room for the vectorcall */
    while (pos < n) {
        Py_ssize_t i = pos, size = 0;
        int digit;
        while (i < n && i - pos < 8 && (digit = hex_value(p[i])) >= 0) {
            size = size * 16 + digit;
            i++;
        }
        if (i == pos || i + 1 >= n || p[i] != '\r' || p[i + 1] != '\n')
            break; /* no plain size line (or not all of it in this read) */
        Py_ssize_t start = i + 2, stop = start + size;
        if (size < 8 || stop + 2 > n || p[stop] != '\r' || p[stop + 1] != '\n')
            break; /* the last chunk, too short to be an event, or not whole */
        if (memcmp(p + start, "data: ", 6) != 0 || p[stop - 2] != '\n' || p[stop - 1] != '\n' ||
            p[stop - 3] == '\r' || memchr(p + start + 6, '\n', size - 8) != NULL)
            break; /* not exactly one one-line data event */
        PyObject *payload = PyBytes_FromStringAndSize(p + start + 6, size - 8);
        if (payload == NULL)
            return NULL;
        call[1] = payload;
        PyObject *result = PyObject_Vectorcall(args[1], call + 1, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(payload);
        if (result == NULL)
            return NULL;
        Py_DECREF(result);
        total += size;
        pos = stop + 2;
    }
    return Py_BuildValue("nn", pos, total);
}

static PyMethodDef methods[] = {
    {"drain", (PyCFunction)(void (*)(void))drain, METH_FASTCALL,
     "drain(epfd, handlers[, loop_epfd, ready, deadline_ns]): read every ready connection and hand "
     "its bytes on; with the loop's epoll, go on reading while nothing else is due."},
    {"sse_chunks", (PyCFunction)(void (*)(void))sse_chunks, METH_FASTCALL,
     "sse_chunks(data, on_event, read_ns, rx_ns): the leading whole one-event chunks to on_event."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rx", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rx(void) {
    name_read_ns = PyUnicode_InternFromString("read_ns");
    name_rx_ns = PyUnicode_InternFromString("rx_ns");
    name_data_received = PyUnicode_InternFromString("data_received");
    name_closed_by_read = PyUnicode_InternFromString("_closed_by_read");
    if (!name_read_ns || !name_rx_ns || !name_data_received || !name_closed_by_read)
        return NULL;
    return PyModule_Create(&module);
}
