// NioEcho: the echo server and client of the runtime conformance suite on the JDK's NIO, in its
// two usual multi-threaded configurations: the server is NIO.2 (an AsynchronousServerSocketChannel
// in a channel group with a fixed pool of 4 threads, completion handlers — the JDK's epoll
// port underneath), the client is classic NIO with a Selector per worker thread (4 workers,
// non-blocking SocketChannels spread over them).
//
//   java -cp target/runtimes/java NioEcho server --port-file F [--host H] [--deadline S]
//   java -cp target/runtimes/java NioEcho client --host H --port P --test echo|rr|many
//        [--count N] [--conns N] [--bytes N]
//
// Protocol (tests/runtimes/README.md): a connection's first byte is its command. 'E': the
// server echoes every following byte until the client's EOF, then shuts down its side and
// closes. 'Q': the server stops listening and exits once its connections are done, printing
// "OK server ...". The client prints "OK client <test>" when every reply matched byte for byte;
// anything else prints FAIL and exits non-zero. A watchdog thread halts with code 3.

import java.io.IOException;
import java.net.InetSocketAddress;
import java.net.StandardSocketOptions;
import java.nio.ByteBuffer;
import java.nio.channels.AsynchronousChannelGroup;
import java.nio.channels.AsynchronousServerSocketChannel;
import java.nio.channels.AsynchronousSocketChannel;
import java.nio.channels.CompletionHandler;
import java.nio.channels.SelectionKey;
import java.nio.channels.Selector;
import java.nio.channels.SocketChannel;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.StandardCopyOption;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.List;
import java.util.Random;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.Executors;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.concurrent.atomic.AtomicLong;

public final class NioEcho {
    static final int[] ECHO_SIZES = {1, 2, 7, 100, 1000, 1460, 4096, 65535, 65536, 100003, 262144, 1 << 20};
    static final int THREADS = 4;

    static String role;
    static String host = "127.0.0.1";
    static int port;
    static String portFile;
    static String test = "echo";
    static int count = 2000, conns = 50, bytes = 256 << 10, deadline = 40;

    static final List<String> errors = Collections.synchronizedList(new ArrayList<>());

    static void fail(String what) {
        errors.add(what);
    }

    static void finish(String ok) {
        if (!errors.isEmpty()) {
            List<String> first;
            synchronized (errors) {
                first = new ArrayList<>(errors.subList(0, Math.min(5, errors.size())));
            }
            System.out.println("FAIL " + role + ": " + String.join("; ", first) + " (" + errors.size() + " error(s))");
            System.out.flush();
            Runtime.getRuntime().halt(1);
        }
        System.out.println("OK " + ok);
        System.out.flush();
        Runtime.getRuntime().halt(0);
    }

    public static void main(String[] args) throws Exception {
        role = args.length > 0 ? args[0] : "?";
        for (int i = 1; i + 1 < args.length; i += 2) {
            String v = args[i + 1];
            switch (args[i]) {
                case "--host": host = v; break;
                case "--port": port = Integer.parseInt(v); break;
                case "--port-file": portFile = v; break;
                case "--test": test = v; break;
                case "--count": count = Integer.parseInt(v); break;
                case "--conns": conns = Integer.parseInt(v); break;
                case "--bytes": bytes = Integer.parseInt(v); break;
                case "--deadline": deadline = Integer.parseInt(v); break;
                default:
                    System.out.println("FAIL unknown option " + args[i]);
                    Runtime.getRuntime().halt(2);
            }
        }
        Thread dog = new Thread(() -> {
            try {
                Thread.sleep(deadline * 1000L);
            } catch (InterruptedException e) {
                return;
            }
            System.out.println("FAIL " + role + ": watchdog: still running after " + deadline + " s");
            System.out.flush();
            Runtime.getRuntime().halt(3);
        });
        dog.setDaemon(true);
        dog.start();
        try {
            if (role.equals("server")) {
                server();
            } else if (role.equals("client")) {
                client();
            } else {
                fail("unknown role " + role);
                finish("");
            }
        } catch (Throwable t) {
            fail(t.toString());
            finish("");
        }
    }

    // ---- server ---------------------------------------------------------------------------

    static final AtomicInteger served = new AtomicInteger();
    static final AtomicInteger active = new AtomicInteger();
    static final AtomicLong echoed = new AtomicLong();
    static final CountDownLatch quit = new CountDownLatch(1);

    static void server() throws Exception {
        AsynchronousChannelGroup group = AsynchronousChannelGroup.withFixedThreadPool(THREADS, Executors.defaultThreadFactory());
        AsynchronousServerSocketChannel srv = AsynchronousServerSocketChannel.open(group);
        srv.bind(new InetSocketAddress(host, 0), 512);
        int p = ((InetSocketAddress) srv.getLocalAddress()).getPort();
        Path tmp = Path.of(portFile + ".tmp");
        Files.writeString(tmp, p + "\n");
        Files.move(tmp, Path.of(portFile), StandardCopyOption.ATOMIC_MOVE);
        srv.accept(null, new CompletionHandler<AsynchronousSocketChannel, Void>() {
            public void completed(AsynchronousSocketChannel ch, Void v) {
                served.incrementAndGet();
                active.incrementAndGet();
                if (quit.getCount() > 0) srv.accept(null, this);
                new Session(ch).start();
            }

            public void failed(Throwable t, Void v) {
                if (quit.getCount() > 0) fail("accept: " + t);
            }
        });
        quit.await();
        srv.close();
        long end = System.nanoTime() + TimeUnit.SECONDS.toNanos(30);
        while (active.get() > 0 && System.nanoTime() < end) Thread.sleep(5);
        if (active.get() > 0) fail(active.get() + " connection(s) still open after the quit");
        finish("server conns=" + served.get() + " bytes=" + echoed.get());
    }

    /** One accepted connection: read, write all of it back, read again, until EOF. */
    static final class Session {
        final AsynchronousSocketChannel ch;
        final ByteBuffer buf = ByteBuffer.allocateDirect(64 << 10);
        boolean gotCmd;

        Session(AsynchronousSocketChannel ch) {
            this.ch = ch;
        }

        void start() {
            try {
                ch.setOption(StandardSocketOptions.TCP_NODELAY, true);
            } catch (IOException e) {
                bad("TCP_NODELAY: " + e);
                return;
            }
            read();
        }

        void bad(String why) {
            fail(why);
            close();
        }

        void close() {
            try {
                ch.close();
            } catch (IOException e) {
                fail("close: " + e);
            }
            active.decrementAndGet();
        }

        void read() {
            buf.clear();
            ch.read(buf, null, new CompletionHandler<Integer, Void>() {
                public void completed(Integer n, Void v) {
                    if (n < 0) {
                        if (!gotCmd) {
                            bad("EOF before the command byte");
                            return;
                        }
                        try {
                            ch.shutdownOutput();
                        } catch (IOException e) {
                            fail("shutdown: " + e);
                        }
                        close();
                        return;
                    }
                    buf.flip();
                    if (!gotCmd && buf.hasRemaining()) {
                        gotCmd = true;
                        byte cmd = buf.get();
                        if (cmd == 'Q') {
                            close();
                            quit.countDown();
                            return;
                        }
                        if (cmd != 'E') {
                            bad("unknown command byte " + cmd);
                            return;
                        }
                    }
                    echoed.addAndGet(buf.remaining());
                    write();
                }

                public void failed(Throwable t, Void v) {
                    bad("echo read: " + t);
                }
            });
        }

        void write() {
            if (!buf.hasRemaining()) {
                read();
                return;
            }
            ch.write(buf, null, new CompletionHandler<Integer, Void>() {
                public void completed(Integer n, Void v) {
                    write();
                }

                public void failed(Throwable t, Void v) {
                    bad("echo write: " + t);
                }
            });
        }
    }

    // ---- client ---------------------------------------------------------------------------

    static byte[] pattern(int c, int k, int n) {
        byte[] b = new byte[n];
        new Random(c * 1_000_003L + k).nextBytes(b);
        return b;
    }

    /** One echo connection, driven by its worker's selector. */
    static final class Conn {
        final int id;
        final int[] sizes;
        final SocketChannel ch;
        int k;
        byte[] msg;
        ByteBuffer out;
        ByteBuffer in;
        boolean finished;
        boolean over;

        Conn(int id, int[] sizes) throws IOException {
            this.id = id;
            this.sizes = sizes;
            ch = SocketChannel.open();
            ch.configureBlocking(false);
        }

        /** Queues message k (with the command byte in front of the first). */
        void load(boolean first) {
            msg = pattern(id, k, sizes[k]);
            out = ByteBuffer.allocate(msg.length + (first ? 1 : 0));
            if (first) out.put((byte) 'E');
            out.put(msg).flip();
            in = ByteBuffer.allocate(msg.length);
        }

        void bad(String why) {
            fail("connection " + id + ": " + why);
            over = true;
            try {
                ch.close();
            } catch (IOException e) {
                // reported already
            }
        }

        /** Handles readiness; returns true when the connection is done (well or not). */
        boolean step(SelectionKey key) throws IOException {
            if (key.isConnectable()) {
                if (!ch.finishConnect()) return false;
                ch.setOption(StandardSocketOptions.TCP_NODELAY, true);
                load(true);
            }
            if (out != null && out.hasRemaining() && (key.isWritable() || key.isConnectable())) ch.write(out);
            if (key.isReadable() || key.isConnectable()) {
                if (finished) {
                    ByteBuffer extra = ByteBuffer.allocate(64);
                    int n = ch.read(extra);
                    if (n < 0) {
                        over = true;
                        ch.close();
                        return true;
                    }
                    if (n > 0) {
                        bad(n + " unexpected byte(s) after the last reply");
                        return true;
                    }
                } else {
                    int n = ch.read(in);
                    if (n < 0) {
                        bad("EOF in message " + k + " after " + in.position() + " byte(s)");
                        return true;
                    }
                    if (!in.hasRemaining()) {
                        byte[] got = in.array();
                        if (!Arrays.equals(got, msg)) {
                            int at = 0;
                            while (got[at] == msg[at]) at++;
                            bad("message " + k + " (" + msg.length + " B): reply differs from byte " + at + " on");
                            return true;
                        }
                        k++;
                        if (k == sizes.length) {
                            finished = true;
                            out = null;
                            ch.shutdownOutput();
                        } else {
                            load(false);
                            ch.write(out);
                        }
                    }
                }
            }
            int ops = SelectionKey.OP_READ;
            if (out != null && out.hasRemaining()) ops |= SelectionKey.OP_WRITE;
            key.interestOps(ops);
            return false;
        }
    }

    /** A worker thread with its own selector and its share of the connections. */
    static void worker(List<Conn> mine, InetSocketAddress addr) {
        try (Selector sel = Selector.open()) {
            int open = 0;
            for (Conn c : mine) {
                if (c.ch.connect(addr)) {
                    c.ch.setOption(StandardSocketOptions.TCP_NODELAY, true);
                    c.load(true);
                    c.ch.register(sel, SelectionKey.OP_READ | SelectionKey.OP_WRITE, c);
                } else {
                    c.ch.register(sel, SelectionKey.OP_CONNECT, c);
                }
                open++;
            }
            while (open > 0) {
                sel.select(1000);
                for (SelectionKey key : sel.selectedKeys()) {
                    Conn c = (Conn) key.attachment();
                    if (c.over) continue;
                    boolean done;
                    try {
                        done = c.step(key);
                    } catch (IOException e) {
                        c.bad(e.toString());
                        done = true;
                    }
                    if (done) {
                        key.cancel();
                        open--;
                    }
                }
                sel.selectedKeys().clear();
            }
        } catch (IOException e) {
            fail("selector: " + e);
        }
    }

    static void client() throws Exception {
        List<int[]> plan = new ArrayList<>();
        if (test.equals("echo")) {
            plan.add(ECHO_SIZES);
        } else if (test.equals("rr")) {
            int[] s = new int[count];
            for (int i = 0; i < count; i++) s[i] = 1 + (i * 7) % 64;
            plan.add(s);
        } else if (test.equals("many")) {
            for (int i = 0; i < conns; i++) plan.add(new int[] {bytes});
        } else {
            fail("unknown test " + test);
            finish("");
        }
        InetSocketAddress addr = new InetSocketAddress(host, port);
        List<List<Conn>> shares = new ArrayList<>();
        for (int w = 0; w < THREADS; w++) shares.add(new ArrayList<>());
        for (int i = 0; i < plan.size(); i++) shares.get(i % THREADS).add(new Conn(i, plan.get(i)));
        List<Thread> workers = new ArrayList<>();
        for (List<Conn> share : shares) {
            if (share.isEmpty()) continue;
            Thread t = new Thread(() -> worker(share, addr));
            t.start();
            workers.add(t);
        }
        for (Thread t : workers) t.join();
        try (SocketChannel q = SocketChannel.open(addr)) {
            q.write(ByteBuffer.wrap(new byte[] {'Q'}));
            int n = q.read(ByteBuffer.allocate(16));
            if (n > 0) fail("quit: " + n + " unexpected byte(s)");
        } catch (IOException e) {
            fail("quit: " + e);
        }
        finish("client " + test);
    }
}
