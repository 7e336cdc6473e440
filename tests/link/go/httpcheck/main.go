// Command httpcheck moves checksummed bytes over HTTP and over a plain TCP stream, for the
// `memloop link` suite (tests/link/run.sh). Statically linked (CGO_ENABLED=0), standard library
// only, Go 1.19.
//
//	httpcheck serve ADDR             HTTP server: GET /data?size=N sends N deterministic bytes
//	                                 with their SHA-256 in the X-Sha256 header; POST /hash
//	                                 answers {"bytes":N,"sha256":"…"} for the body it read
//	httpcheck get URL SIZE           downloads URL/data?size=SIZE; checks length, header, bytes
//	httpcheck post URL SIZE          uploads SIZE deterministic bytes to URL/hash; checks the
//	                                 server's answer
//	httpcheck recv ADDR              accepts one stream (8-byte length N, N bytes, their
//	                                 SHA-256), checks it against the expected bytes, answers
//	                                 with its own SHA-256
//	httpcheck send ADDR SIZE [MIBPS] sends such a stream (at most MIBPS MiB/s), then waits for
//	                                 the receiver's SHA-256 and compares
//
// SIZE takes K, M, G suffixes (powers of 1024). Servers print "listening ADDR" on stdout once
// they listen; every command prints one JSON line of results on stdout and exits 1 (with the
// reason on stderr) when a check fails. recv and send print their progress on stderr.
package main

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// The streams' seeds: each use has its own bytes.
const (
	seedGet  = 1
	seedPost = 2
	seedSend = 3
)

const chunk = 256 << 10

func main() {
	if len(os.Args) < 3 {
		usage()
	}
	var err error
	switch args := os.Args[2:]; os.Args[1] {
	case "serve":
		err = serve(args[0])
	case "get":
		err = withSize(args, get)
	case "post":
		err = withSize(args, post)
	case "recv":
		err = recv(args[0])
	case "send":
		err = withSize(args, func(addr string, size int64) error {
			rate := 0.0
			if len(args) > 2 {
				r, perr := strconv.ParseFloat(args[2], 64)
				if perr != nil || r < 0 {
					return fmt.Errorf("MIBPS %q: not a rate", args[2])
				}
				rate = r
			}
			return send(addr, size, rate)
		})
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "httpcheck %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: httpcheck serve ADDR | get URL SIZE | post URL SIZE | recv ADDR | send ADDR SIZE [MIBPS]")
	os.Exit(2)
}

func withSize(args []string, f func(string, int64) error) error {
	if len(args) < 2 {
		usage()
	}
	n, err := parseSize(args[1])
	if err != nil {
		return err
	}
	return f(args[0], n)
}

func parseSize(s string) (int64, error) {
	mult := int64(1)
	switch {
	case strings.HasSuffix(s, "K"):
		mult = 1 << 10
	case strings.HasSuffix(s, "M"):
		mult = 1 << 20
	case strings.HasSuffix(s, "G"):
		mult = 1 << 30
	}
	n, err := strconv.ParseInt(strings.TrimRight(s, "KMG"), 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("size %q: want a number with an optional K, M or G", s)
	}
	return n * mult, nil
}

// stream yields n deterministic pseudo-random bytes (xorshift64, 8 bytes a step): the same seed
// and length give the same bytes however they are read.
type stream struct {
	state uint64
	left  int64
	buf   []byte
	off   int
}

func newStream(seed uint64, n int64) *stream {
	return &stream{state: seed*0x9E3779B97F4A7C15 | 1, left: n}
}

func (s *stream) Read(p []byte) (int, error) {
	if s.left == 0 {
		return 0, io.EOF
	}
	if s.off == len(s.buf) {
		if s.buf == nil {
			s.buf = make([]byte, chunk)
		}
		for i := 0; i < len(s.buf); i += 8 {
			s.state ^= s.state << 13
			s.state ^= s.state >> 7
			s.state ^= s.state << 17
			binary.LittleEndian.PutUint64(s.buf[i:], s.state)
		}
		s.off = 0
	}
	n := copy(p, s.buf[s.off:])
	if int64(n) > s.left {
		n = int(s.left)
	}
	s.off += n
	s.left -= int64(n)
	return n, nil
}

func streamSum(seed uint64, n int64) string {
	h := sha256.New()
	if _, err := io.Copy(h, newStream(seed, n)); err != nil {
		panic(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// report prints one JSON line of results.
func report(fields map[string]interface{}, n int64, start time.Time) {
	secs := time.Since(start).Seconds()
	fields["bytes"] = n
	fields["seconds"] = secs
	if secs > 0 {
		fields["mib_per_s"] = float64(n) / (1 << 20) / secs
	}
	b, _ := json.Marshal(fields)
	fmt.Println(string(b))
}

// ---------------------------------------------------------------------------------------------
// HTTP

func serve(addr string) error {
	var mu sync.Mutex
	sums := map[int64]string{}
	mux := http.NewServeMux()
	mux.HandleFunc("/data", func(w http.ResponseWriter, r *http.Request) {
		n, err := strconv.ParseInt(r.URL.Query().Get("size"), 10, 64)
		if err != nil || n < 0 {
			http.Error(w, "size: want a number of bytes", http.StatusBadRequest)
			return
		}
		mu.Lock()
		sum, ok := sums[n]
		if !ok {
			sum = streamSum(seedGet, n)
			sums[n] = sum
		}
		mu.Unlock()
		w.Header().Set("X-Sha256", sum)
		w.Header().Set("Content-Length", strconv.FormatInt(n, 10))
		w.Header().Set("Content-Type", "application/octet-stream")
		if _, err := io.Copy(w, newStream(seedGet, n)); err != nil {
			fmt.Fprintf(os.Stderr, "serve: GET %s: %v\n", r.URL, err)
		}
	})
	mux.HandleFunc("/hash", func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			http.Error(w, "POST only", http.StatusMethodNotAllowed)
			return
		}
		h := sha256.New()
		n, err := io.Copy(h, r.Body)
		if err != nil {
			fmt.Fprintf(os.Stderr, "serve: POST body after %d bytes: %v\n", n, err)
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(map[string]interface{}{
			"bytes": n, "sha256": hex.EncodeToString(h.Sum(nil)),
		})
	})
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	fmt.Printf("listening %s\n", l.Addr())
	return http.Serve(l, mux)
}

func get(url string, size int64) error {
	start := time.Now()
	resp, err := http.Get(fmt.Sprintf("%s/data?size=%d", url, size))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET: %s", resp.Status)
	}
	h := sha256.New()
	n, err := io.Copy(h, resp.Body)
	if err != nil {
		return fmt.Errorf("body after %d bytes: %v", n, err)
	}
	got := hex.EncodeToString(h.Sum(nil))
	if n != size {
		return fmt.Errorf("got %d bytes, want %d", n, size)
	}
	if hdr := resp.Header.Get("X-Sha256"); got != hdr {
		return fmt.Errorf("SHA-256 of the body %s, the server's header says %q", got, hdr)
	}
	if want := streamSum(seedGet, size); got != want {
		return fmt.Errorf("SHA-256 of the body %s, expected %s", got, want)
	}
	report(map[string]interface{}{"op": "get", "sha256": got}, n, start)
	return nil
}

func post(url string, size int64) error {
	start := time.Now()
	resp, err := http.Post(url+"/hash", "application/octet-stream",
		io.LimitReader(newStream(seedPost, size), size))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("POST: %s: %s", resp.Status, body)
	}
	var ans struct {
		Bytes  int64  `json:"bytes"`
		Sha256 string `json:"sha256"`
	}
	if err := json.Unmarshal(body, &ans); err != nil {
		return fmt.Errorf("answer %q: %v", body, err)
	}
	want := streamSum(seedPost, size)
	if ans.Bytes != size || ans.Sha256 != want {
		return fmt.Errorf("the server read %d bytes with SHA-256 %s; sent %d with %s",
			ans.Bytes, ans.Sha256, size, want)
	}
	report(map[string]interface{}{"op": "post", "sha256": want}, size, start)
	return nil
}

// ---------------------------------------------------------------------------------------------
// Raw TCP stream (survives the link's outages: no deadlines)

// progress prints "WHAT: N bytes" on stderr every 200 ms until stop is closed.
func progress(what string, n *int64, mu *sync.Mutex, stop chan struct{}) {
	t := time.NewTicker(200 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
			mu.Lock()
			v := *n
			mu.Unlock()
			fmt.Fprintf(os.Stderr, "%s: %d bytes\n", what, v)
		}
	}
}

func recv(addr string) error {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	fmt.Printf("listening %s\n", l.Addr())
	c, err := l.Accept()
	l.Close()
	if err != nil {
		return err
	}
	defer c.Close()
	start := time.Now()
	r := bufio.NewReaderSize(c, chunk)
	var hdr [8]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return fmt.Errorf("reading the length: %v", err)
	}
	size := int64(binary.BigEndian.Uint64(hdr[:]))
	var (
		mu   sync.Mutex
		done int64
	)
	stop := make(chan struct{})
	defer close(stop)
	go progress("recv", &done, &mu, stop)
	want := newStream(seedSend, size)
	h := sha256.New()
	buf := make([]byte, chunk)
	exp := make([]byte, chunk)
	for off := int64(0); off < size; {
		k := int64(len(buf))
		if size-off < k {
			k = size - off
		}
		n, err := r.Read(buf[:k])
		if n > 0 {
			if _, werr := io.ReadFull(want, exp[:n]); werr != nil {
				return werr
			}
			if !bytes.Equal(buf[:n], exp[:n]) {
				i := 0
				for buf[i] == exp[i] {
					i++
				}
				return fmt.Errorf("byte %d of %d differs: got %#02x, want %#02x",
					off+int64(i), size, buf[i], exp[i])
			}
			h.Write(buf[:n])
			off += int64(n)
			mu.Lock()
			done = off
			mu.Unlock()
		}
		if err != nil {
			return fmt.Errorf("after %d of %d bytes: %v", off, size, err)
		}
	}
	sum := h.Sum(nil)
	var trailer [sha256.Size]byte
	if _, err := io.ReadFull(r, trailer[:]); err != nil {
		return fmt.Errorf("reading the sender's SHA-256: %v", err)
	}
	if !bytes.Equal(trailer[:], sum) {
		return fmt.Errorf("SHA-256 %x, the sender says %x", sum, trailer)
	}
	if _, err := c.Write(sum); err != nil {
		return fmt.Errorf("answering: %v", err)
	}
	if n, err := r.Read(hdr[:1]); n != 0 || !errors.Is(err, io.EOF) {
		return fmt.Errorf("expected the end of the stream, got %d bytes (%v)", n, err)
	}
	report(map[string]interface{}{"op": "recv", "sha256": hex.EncodeToString(sum)}, size, start)
	return nil
}

func send(addr string, size int64, mibps float64) error {
	var c net.Conn
	var err error
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if c, err = net.Dial("tcp", addr); err == nil || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		return err
	}
	defer c.Close()
	start := time.Now()
	var hdr [8]byte
	binary.BigEndian.PutUint64(hdr[:], uint64(size))
	if _, err := c.Write(hdr[:]); err != nil {
		return err
	}
	var (
		mu   sync.Mutex
		sent int64
	)
	stop := make(chan struct{})
	defer close(stop)
	go progress("send", &sent, &mu, stop)
	src := newStream(seedSend, size)
	h := sha256.New()
	buf := make([]byte, chunk)
	for off := int64(0); off < size; {
		n, _ := io.ReadFull(src, buf)
		if _, err := c.Write(buf[:n]); err != nil {
			return fmt.Errorf("after %d of %d bytes: %v", off, size, err)
		}
		h.Write(buf[:n])
		off += int64(n)
		mu.Lock()
		sent = off
		mu.Unlock()
		if mibps > 0 {
			due := time.Duration(float64(off) / (mibps * (1 << 20)) * float64(time.Second))
			if ahead := due - time.Since(start); ahead > 0 {
				time.Sleep(ahead)
			}
		}
	}
	sum := h.Sum(nil)
	if _, err := c.Write(sum); err != nil {
		return err
	}
	if tc, ok := c.(*net.TCPConn); ok {
		tc.CloseWrite()
	}
	var ans [sha256.Size]byte
	if _, err := io.ReadFull(c, ans[:]); err != nil {
		return fmt.Errorf("reading the receiver's SHA-256: %v", err)
	}
	if !bytes.Equal(ans[:], sum) {
		return fmt.Errorf("the receiver's SHA-256 %x, sent %x", ans, sum)
	}
	report(map[string]interface{}{"op": "send", "sha256": hex.EncodeToString(sum)}, size, start)
	return nil
}
