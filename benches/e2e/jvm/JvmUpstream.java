// A thread-per-connection HTTP/1.1 upstream for the end-to-end benchmark (benches/e2e/run.sh, scenario "jvm").
//
// It stands for the classic blocking JVM server (and for Ktor CIO and the like, whose threads follow connections):
// one ServerSocket accept loop, one platform thread per accepted connection for as long as the connection lives.
// Every request is answered "200 ok" after a fixed service time (Thread.sleep), so what a proxy in front of it
// saves shows up as threads and resident memory the JVM never needs.
//
// It counts, exactly, with the same field names and the same window semantics as examples/bench_upstream.rs:
// connections open now and at their peak (from accept until the connection's thread lets go of the socket),
// requests in flight now and at their peak (from the end of the request head and body until the response is
// handed to the socket: the service time is inside, the write is not), connections accepted, requests served.
// And the JVM's side: Java threads now and at their peak (ThreadMXBean: every live java.lang.Thread, daemon or not;
// the VM's own GC and JIT threads are not Java threads and are not in it), base_threads (the live Java threads
// just before the first accept: main, this server's control thread and the JVM's housekeeping threads), the
// threads this server started for connections (conn_threads, peak_conn_threads), the process's OS threads, and
// VmRSS / VmHWM from /proc/self/status.
//
// Control listener, so that reading the counts never shows up in them: GET /stats gives them as one JSON object;
// POST or GET /reset starts a new window (peaks drop to the current values, accepted/served/refused to zero, the
// ThreadMXBean peak to the live count, and VmHWM to the current RSS through /proc/self/clear_refs) and gives the
// counts as they were before.
//
// Usage: java [-Xms256m -Xmx256m -Xss256k ...] -cp DIR JvmUpstream [--delay-ms MS] [--listen HOST:PORT]
//        [--control HOST:PORT] [--max-conns N] [--backlog N] [--cold-keys K --cold-work ROUNDS]
//
// --cold-keys makes it a service that warms up (benches/upstream_aware.py, scenario jvm-warm): each request's target
// names one of K keys, whose value is computed on a miss (ROUNDS of SHA-256 over 1 KiB, real CPU, interpreted until
// the JIT has compiled it) and then cached, without single-flight: concurrent misses on one key each compute it, as
// a cache that does not lock its loads does (Spring's @Cacheable without sync = true, a get-then-put map). Cold, it
// is slow, and slower the more requests it is sent at once; once every key is cached, only --delay-ms is left.
// Prints "jvm upstream ready listen=HOST:PORT control=HOST:PORT ..." once both listeners are bound.
//
// --max-conns bounds the threads it can start: a connection beyond it is closed at once and counted as refused,
// so that a load generator pointed straight at it cannot make it start threads until the machine runs out.

import java.io.BufferedInputStream;
import java.io.BufferedOutputStream;
import java.io.EOFException;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.lang.management.ManagementFactory;
import java.lang.management.ThreadMXBean;
import java.net.InetSocketAddress;
import java.net.ServerSocket;
import java.net.Socket;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.util.List;
import java.util.Locale;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.atomic.AtomicLong;

public final class JvmUpstream {
    /** A gauge that remembers its highest value since the last reset. */
    static final class PeakGauge {
        final AtomicLong now = new AtomicLong();
        final AtomicLong peak = new AtomicLong();

        void up() {
            long n = now.incrementAndGet();
            // Every value the gauge takes passes through here once, so the peak is exact, not sampled.
            peak.accumulateAndGet(n, Math::max);
        }

        void down() {
            now.decrementAndGet();
        }

        void reset() {
            peak.set(now.get());
            // An up() between the two reads above may have raised now; keep the peak at least there.
            peak.accumulateAndGet(now.get(), Math::max);
        }
    }

    /**
     * How long the server spent at each number of requests in flight since the last reset (the last entry also takes
     * every level above it): the share of a window it worked at a proxy's cap N is the time at levels >= N.
     */
    static final class LevelClock {
        static final int LEVELS = 1025;
        private int level;
        private long since = System.nanoTime();
        private long windowStart = since;
        private long[] timeNs = new long[LEVELS];
        private int highest;

        synchronized void change(boolean up) {
            closeSpan(System.nanoTime());
            level = up ? level + 1 : Math.max(0, level - 1);
        }

        private void closeSpan(long now) {
            int at = Math.min(level, LEVELS - 1);
            timeNs[at] += now - since;
            highest = Math.max(highest, at);
            since = now;
        }

        /** `"window_us":W,"inflight_time_us":[...]`; a reset also starts a new window. */
        synchronized String read(boolean reset) {
            long now = System.nanoTime();
            closeSpan(now);
            StringBuilder out = new StringBuilder();
            out.append("\"window_us\":").append((now - windowStart) / 1000).append(",\"inflight_time_us\":[");
            for (int i = 0; i <= highest; i++) {
                out.append(i == 0 ? "" : ",").append(timeNs[i] / 1000);
            }
            out.append(']');
            if (reset) {
                windowStart = now;
                timeNs = new long[LEVELS];
                highest = 0;
            }
            return out.toString();
        }
    }

    static final LevelClock levels = new LevelClock();
    static final PeakGauge conns = new PeakGauge();
    static final PeakGauge inflight = new PeakGauge();
    static final PeakGauge connThreads = new PeakGauge();
    static final AtomicLong accepted = new AtomicLong();
    static final AtomicLong served = new AtomicLong();
    static final AtomicLong refused = new AtomicLong();
    static final ThreadMXBean mx = ManagementFactory.getThreadMXBean();
    static volatile int baseThreads;
    static volatile boolean hwmResets = true;
    static long delayMs;
    static int coldKeys;
    static int coldWork;
    static final ConcurrentHashMap<Integer, byte[]> cache = new ConcurrentHashMap<>();
    static final AtomicLong computed = new AtomicLong();

    /** The value of a key as a cold service computes it on a miss: CPU work, and the same work for every caller. */
    static byte[] compute(int key) {
        try {
            MessageDigest digest = MessageDigest.getInstance("SHA-256");
            byte[] block = new byte[1024];
            block[0] = (byte) key;
            byte[] value = block;
            for (int round = 0; round < coldWork; round++) {
                digest.update(block);
                value = digest.digest(value);
            }
            computed.incrementAndGet();
            return value;
        } catch (NoSuchAlgorithmException e) {
            throw new IllegalStateException(e);
        }
    }

    /** The cached value of the key `target` names (its last path segment's number, else its hash), computed on a
     *  miss without a lock: a miss seen by two callers at once is computed twice. */
    static void lookUp(String target) {
        int key;
        try {
            key = Math.floorMod(Integer.parseInt(target.substring(target.lastIndexOf('/') + 1)), coldKeys);
        } catch (NumberFormatException e) {
            key = Math.floorMod(target.hashCode(), coldKeys);
        }
        if (cache.get(key) == null) {
            cache.put(key, compute(key));
        }
    }

    static final int MAX_LINE = 8192;
    static final int MAX_HEADERS = 100;
    static final byte[] OK = ascii("HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 3\r\n\r\nok\n");
    static final byte[] OK_CLOSE =
            ascii("HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n");

    static byte[] ascii(String s) {
        return s.getBytes(StandardCharsets.ISO_8859_1);
    }

    /** A parsed request head; the body, if any, has been read past already. */
    record Request(String method, String target, boolean keepAlive) {}

    /** The request could not be parsed; the connection is answered with this status and closed. */
    static final class BadRequest extends IOException {
        private static final long serialVersionUID = 1L;
        final int status;

        BadRequest(int status, String why) {
            super(why);
            this.status = status;
        }
    }

    /** One line without its CRLF (or bare LF); null at end of stream before any byte of it. */
    static String readLine(InputStream in) throws IOException {
        StringBuilder line = new StringBuilder(64);
        while (true) {
            int b = in.read();
            if (b < 0) {
                if (line.length() == 0) {
                    return null;
                }
                throw new EOFException("connection closed inside a line");
            }
            if (b == '\n') {
                int n = line.length();
                if (n > 0 && line.charAt(n - 1) == '\r') {
                    line.setLength(n - 1);
                }
                return line.toString();
            }
            if (line.length() >= MAX_LINE) {
                throw new BadRequest(431, "line too long");
            }
            line.append((char) b);
        }
    }

    /** Reads one request (head and Content-Length body); null when the client closed between requests. */
    static Request readRequest(InputStream in) throws IOException {
        String first = readLine(in);
        // RFC 9112 2.2: empty lines before a request line are ignored.
        while (first != null && first.isEmpty()) {
            first = readLine(in);
        }
        if (first == null) {
            return null;
        }
        String[] parts = first.split(" ");
        if (parts.length != 3 || !parts[2].startsWith("HTTP/1.")) {
            throw new BadRequest(400, "bad request line");
        }
        boolean http10 = parts[2].equals("HTTP/1.0");
        long length = 0;
        boolean close = http10;
        for (int i = 0; ; i++) {
            String h = readLine(in);
            if (h == null) {
                throw new EOFException("connection closed inside the head");
            }
            if (h.isEmpty()) {
                break;
            }
            if (i >= MAX_HEADERS) {
                throw new BadRequest(431, "too many headers");
            }
            int colon = h.indexOf(':');
            if (colon <= 0) {
                throw new BadRequest(400, "bad header line");
            }
            String name = h.substring(0, colon).trim().toLowerCase(Locale.ROOT);
            String value = h.substring(colon + 1).trim();
            switch (name) {
                case "content-length" -> {
                    try {
                        length = Long.parseLong(value);
                    } catch (NumberFormatException e) {
                        throw new BadRequest(400, "bad content-length");
                    }
                    if (length < 0) {
                        throw new BadRequest(400, "bad content-length");
                    }
                }
                // Chunked bodies are not needed by any scenario; refusing them keeps the parser small and honest.
                case "transfer-encoding" -> throw new BadRequest(501, "transfer-encoding not supported");
                case "connection" -> {
                    for (String token : value.toLowerCase(Locale.ROOT).split(",")) {
                        String t = token.trim();
                        if (t.equals("close")) {
                            close = true;
                        } else if (t.equals("keep-alive")) {
                            close = false;
                        }
                    }
                }
                default -> {}
            }
        }
        while (length > 0) {
            long skipped = in.skip(length);
            if (skipped <= 0) {
                // skip() may return 0 without being at the end; read() tells the two apart.
                if (in.read() < 0) {
                    throw new EOFException("connection closed inside the body");
                }
                skipped = 1;
            }
            length -= skipped;
        }
        return new Request(parts[0], parts[1], !close);
    }

    static void writeStatus(OutputStream out, int status) throws IOException {
        String reason = switch (status) {
            case 400 -> "Bad Request";
            case 404 -> "Not Found";
            case 431 -> "Request Header Fields Too Large";
            case 501 -> "Not Implemented";
            default -> "Error";
        };
        out.write(ascii("HTTP/1.1 " + status + " " + reason + "\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"));
        out.flush();
    }

    /** The body of a connection's own thread; conns was counted up by the accept loop. */
    static void serveConnection(Socket socket) {
        connThreads.up();
        try (socket) {
            socket.setTcpNoDelay(true);
            InputStream in = new BufferedInputStream(socket.getInputStream(), 8192);
            OutputStream out = new BufferedOutputStream(socket.getOutputStream(), 512);
            while (true) {
                Request req;
                try {
                    req = readRequest(in);
                } catch (BadRequest e) {
                    writeStatus(out, e.status);
                    return;
                }
                if (req == null) {
                    return;
                }
                inflight.up();
                levels.change(true);
                try {
                    if (coldKeys > 0) {
                        lookUp(req.target());
                    }
                    if (delayMs > 0) {
                        Thread.sleep(delayMs);
                    }
                    served.incrementAndGet();
                } finally {
                    inflight.down();
                    levels.change(false);
                }
                out.write(req.keepAlive() ? OK : OK_CLOSE);
                out.flush();
                if (!req.keepAlive()) {
                    return;
                }
            }
        } catch (IOException e) {
            // Resets and the like are the client's doing; the connection is over either way.
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
        } finally {
            conns.down();
            connThreads.down();
        }
    }

    static long procStatusKb(String key) {
        try {
            List<String> lines = Files.readAllLines(Path.of("/proc/self/status"));
            for (String l : lines) {
                if (l.startsWith(key + ":")) {
                    return Long.parseLong(l.substring(key.length() + 1).trim().split("\\s+")[0]);
                }
            }
        } catch (IOException | NumberFormatException e) {
            // Not Linux, or an unexpected format: report -1 rather than a made-up figure.
        }
        return -1;
    }

    static String snapshot() {
        return snapshot(false);
    }

    static String snapshot(boolean resetLevels) {
        return String.format(Locale.ROOT,
                "{" + levels.read(resetLevels) + ",\"conns\":%d,\"peak_conns\":%d,\"inflight\":%d,\"peak_inflight\":%d,\"accepted\":%d,\"served\":%d,"
                        + "\"refused\":%d,\"conn_threads\":%d,\"peak_conn_threads\":%d,\"threads\":%d,"
                        + "\"peak_threads\":%d,\"base_threads\":%d,\"os_threads\":%d,\"rss_kb\":%d,\"hwm_kb\":%d,"
                        + "\"hwm_window\":%b,\"delay_ms\":%d,\"cold_computed\":%d}",
                conns.now.get(), conns.peak.get(), inflight.now.get(), inflight.peak.get(), accepted.get(),
                served.get(), refused.get(), connThreads.now.get(), connThreads.peak.get(), mx.getThreadCount(),
                mx.getPeakThreadCount(), baseThreads, procStatusKb("Threads"), procStatusKb("VmRSS"),
                procStatusKb("VmHWM"), hwmResets, delayMs, computed.get());
    }

    static String reset() {
        String before = snapshot(true);
        conns.reset();
        inflight.reset();
        connThreads.reset();
        accepted.set(0);
        served.set(0);
        refused.set(0);
        mx.resetPeakThreadCount();
        try {
            // "5" resets VmHWM to the current RSS (Linux >= 4.0): the next window's peak is its own.
            Files.writeString(Path.of("/proc/self/clear_refs"), "5");
        } catch (IOException | SecurityException e) {
            hwmResets = false;
        }
        return before;
    }

    /** The control listener: one connection at a time, which also keeps a snapshot and a reset apart. */
    static void controlLoop(ServerSocket control) {
        while (true) {
            try (Socket s = control.accept()) {
                InputStream in = new BufferedInputStream(s.getInputStream());
                OutputStream out = new BufferedOutputStream(s.getOutputStream());
                Request req;
                try {
                    req = readRequest(in);
                } catch (BadRequest e) {
                    writeStatus(out, e.status);
                    continue;
                }
                if (req == null) {
                    continue;
                }
                String path = req.target();
                String body;
                if (req.method().equals("GET") && path.equals("/stats")) {
                    body = snapshot();
                } else if ((req.method().equals("GET") || req.method().equals("POST")) && path.equals("/reset")) {
                    body = reset();
                } else {
                    writeStatus(out, 404);
                    continue;
                }
                byte[] b = (body + "\n").getBytes(StandardCharsets.UTF_8);
                out.write(ascii("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " + b.length
                        + "\r\nConnection: close\r\n\r\n"));
                out.write(b);
                out.flush();
            } catch (IOException e) {
                System.err.println("jvm upstream: control: " + e);
            }
        }
    }

    static InetSocketAddress parseAddr(String s) {
        int colon = s.lastIndexOf(':');
        if (colon <= 0) {
            throw new IllegalArgumentException("expected HOST:PORT, got " + s);
        }
        return new InetSocketAddress(s.substring(0, colon), Integer.parseInt(s.substring(colon + 1)));
    }

    static String show(ServerSocket s) {
        return s.getInetAddress().getHostAddress() + ":" + s.getLocalPort();
    }

    public static void main(String[] args) throws IOException {
        InetSocketAddress listen = parseAddr("127.0.0.1:0");
        InetSocketAddress controlAddr = parseAddr("127.0.0.1:0");
        int maxConns = 10000;
        int backlog = 4096;
        for (int i = 0; i < args.length; i++) {
            String value = i + 1 < args.length ? args[i + 1] : null;
            if (value == null) {
                System.err.println("jvm upstream: " + args[i] + " needs a value");
                System.exit(2);
            }
            switch (args[i++]) {
                case "--delay-ms" -> delayMs = Long.parseLong(value);
                case "--listen" -> listen = parseAddr(value);
                case "--control" -> controlAddr = parseAddr(value);
                case "--max-conns" -> maxConns = Integer.parseInt(value);
                case "--backlog" -> backlog = Integer.parseInt(value);
                case "--cold-keys" -> coldKeys = Integer.parseInt(value);
                case "--cold-work" -> coldWork = Integer.parseInt(value);
                default -> {
                    System.err.println("jvm upstream: unknown option " + args[i - 1]);
                    System.exit(2);
                }
            }
        }

        ServerSocket data = new ServerSocket();
        data.setReuseAddress(true);
        // wrk opens all its connections at once; a short backlog would turn that burst into SYN retries.
        data.bind(listen, backlog);
        ServerSocket control = new ServerSocket();
        control.setReuseAddress(true);
        control.bind(controlAddr, 16);

        Thread ctl = new Thread(() -> controlLoop(control), "control");
        ctl.setDaemon(true);
        ctl.start();
        Runtime.getRuntime().addShutdownHook(new Thread(() -> System.out.println(snapshot()), "final-counts"));
        // Give the JVM's housekeeping threads a moment to exist, so that they are in the baseline, not counted
        // later as threads the load made.
        try {
            Thread.sleep(200);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
        }
        baseThreads = mx.getThreadCount();
        mx.resetPeakThreadCount();
        System.out.println("jvm upstream ready listen=" + show(data) + " control=" + show(control) + " delay_ms="
                + delayMs + " base_threads=" + baseThreads + " max_conns=" + maxConns);
        System.out.flush();

        long n = 0;
        while (true) {
            Socket s;
            try {
                s = data.accept();
            } catch (IOException e) {
                // Out of file descriptors and the like: wait a little rather than spin or die.
                System.err.println("jvm upstream: accept: " + e);
                try {
                    Thread.sleep(10);
                } catch (InterruptedException ie) {
                    Thread.currentThread().interrupt();
                }
                continue;
            }
            // Only this loop raises conns, so the check cannot be overtaken.
            if (conns.now.get() >= maxConns) {
                refused.incrementAndGet();
                s.close();
                continue;
            }
            // Counted before the thread starts, so no accepted connection is ever missed.
            conns.up();
            accepted.incrementAndGet();
            Thread t = new Thread(() -> serveConnection(s), "conn-" + (++n));
            t.setDaemon(true);
            try {
                t.start();
            } catch (OutOfMemoryError e) {
                // "unable to create native thread": refuse this one and carry on rather than die.
                conns.down();
                accepted.decrementAndGet();
                refused.incrementAndGet();
                s.close();
                System.err.println("jvm upstream: thread start: " + e);
            }
        }
    }
}
